"""The pipeline: groups flow from a source (workers) to the learner, one iteration at a time."""

from cadence.pipeline.build import Run, build_run
from cadence.pipeline.loop import StaleGroupError, on_policy, run_iteration, train
from cadence.pipeline.source import ColocatedSource, GroupSource
from cadence.pipeline.worker import RolloutWorker

__all__ = [
    "ColocatedSource",
    "GroupSource",
    "RolloutWorker",
    "Run",
    "StaleGroupError",
    "build_run",
    "on_policy",
    "run_iteration",
    "train",
]
