"""The policy acting: a rollout worker turns prompts into scored groups with an engine, a reward
and (multi-turn) an environment; held-out evaluation runs the same code greedily; a worker is
built from a plain `WorkerSpec` in whatever process runs it.

This room holds what the policy does, not how work reaches it: processes, pools, transports and
Ray adapters are backend/'s, which runs these workers. It must not read the config (the builder
passes plain values) nor know what an iteration of training is.
"""

from cadence.rollout.episodes import EpisodeRunner
from cadence.rollout.evaluate import Evaluator, evaluate
from cadence.rollout.spec import WorkerSpec, build_worker, evaluation_spec
from cadence.rollout.worker import PartialRollouts, RolloutWorker

__all__ = [
    "EpisodeRunner",
    "Evaluator",
    "PartialRollouts",
    "RolloutWorker",
    "WorkerSpec",
    "build_worker",
    "evaluate",
    "evaluation_spec",
]
