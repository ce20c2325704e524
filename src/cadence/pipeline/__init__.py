"""The pipeline: groups flow from a source (workers) to the learner, one iteration at a time.

It owns the run loop (`loop`), the producer that hands prompts to the workers and admits
iterations (`producer`, with worker `recovery`), the sources the learner reads (`source`), the
run builder (`build`, with the config translations in `params`), the data cursor (`prompts`),
held-out evaluation and checkpoints. Process machinery and weight transport live in
`cadence.backend`, the sample store in `cadence.dataplane`, figures in `cadence.metrics`.
"""

from cadence.pipeline.build import build_run
from cadence.pipeline.loop import LoopParams, Run, StaleGroupError, on_policy, run_iteration, train
from cadence.pipeline.source import ColocatedSource, GroupSource, WorkerSource

__all__ = [
    "ColocatedSource",
    "GroupSource",
    "LoopParams",
    "Run",
    "StaleGroupError",
    "WorkerSource",
    "build_run",
    "on_policy",
    "run_iteration",
    "train",
]
