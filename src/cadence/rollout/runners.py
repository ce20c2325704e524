"""What runs a worker's multi-turn episodes, chosen by the environment it is given.

cadence's own environments (tools, environment classes, OpenEnv) run in its episode runner
(rollout/episodes.py); a verifiers environment runs its own rollouts against the worker's engine
(rollout/verifiers.py, imported only for it). The one place that tells them apart.
"""

from __future__ import annotations

from cadence.engine import SamplingParams, StreamingEngine
from cadence.envs import Environment, VerifiersEnv
from cadence.rollout.episodes import EpisodeRunner


def make_episodes(
    env: Environment | VerifiersEnv, engine: StreamingEngine, tokenizer, sampling: SamplingParams
):
    """The runner of `env`'s episodes on `engine`."""
    if isinstance(env, VerifiersEnv):
        from cadence.rollout.verifiers import VerifiersRunner

        return VerifiersRunner(env, engine, tokenizer, sampling)
    return EpisodeRunner(engine, tokenizer, env, sampling)
