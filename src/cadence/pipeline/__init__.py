"""The runtime: groups flow from a source (workers) to the learner, one iteration at a time.

It owns the run loop (`loop`), its outputs (`outputs`), the producer that hands prompts to the
workers and admits iterations (`producer`, with worker `recovery` and the version `gate`), the
sources the learner reads (`source`), the data cursor (`prompts`) and checkpoints. It never reads
the config: the builder (`cadence.builder`) wires it from plain values.
"""

from cadence.pipeline.loop import run_iteration, train
from cadence.pipeline.run import LoopParams, Run
from cadence.pipeline.source import ColocatedSource, GroupSource, WorkerSource

__all__ = [
    "ColocatedSource",
    "GroupSource",
    "LoopParams",
    "Run",
    "WorkerSource",
    "run_iteration",
    "train",
]
