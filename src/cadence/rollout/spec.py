"""A rollout worker built from plain values, in whatever process it is to run.

`WorkerSpec` is everything a worker needs (picklable: a process or a Ray actor is sent it) and
`build_worker` assembles the worker from it: the engine and the weights it decodes with (through
the engine factory, which alone knows whether an engine keeps its own copy), the reward, the
environment. It lives here rather than beside the message loop in backend/ because choosing what
acts is the policy's side: backend/ carries a spec to a process, calls `build_worker`, loads
weights through what it returns, and must not know which engine, reward or environment a worker
holds. transformers is imported inside `build_worker`, not before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cadence.engine import Engine, EngineWeights, SamplingParams
from cadence.engine.weights import EngineAdapter
from cadence.envs import EnvSpec
from cadence.rollout.worker import PartialRollouts, RolloutWorker

if TYPE_CHECKING:
    from cadence.engine.vllm import VLLMOptions

    EngineOptions = VLLMOptions  # the options of each engine that takes some (choices.ENGINES)
    from cadence.models.lora import AdapterSpec
    from cadence.rewards import RewardScorer


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build itself (plain, picklable values)."""

    model_path: str
    dtype: str
    reward: str  # the reward function's spec; "" when a reward stage scores instead
    sampling: SamplingParams
    group_size: int
    run_seed: int
    threads: int
    max_num_seqs: int
    engine: str = "continuous"
    reward_timeout_s: float = 0.0  # longest one reward call may take (0: no limit)
    reward_concurrency: int | None = None  # reward calls in flight at once (None: its default)
    answer_format: str = "auto"  # reward.answer_format of the "math" reward
    env: EnvSpec = field(default_factory=EnvSpec)  # single turn unless told otherwise
    engine_options: EngineOptions | None = None  # the engine's own settings, if it takes some
    partial: PartialRollouts | None = None  # new weights between decode steps (partial rollouts)
    device: str = "cpu"  # where an engine that decodes a model object holds it ("cuda": the
    # first GPU the worker's process sees; vLLM places itself on that same GPU)
    adapter: AdapterSpec | None = None  # versions arrive as this LoRA adapter alone (vLLM)


def evaluation_spec(spec: WorkerSpec, reward: str) -> WorkerSpec:
    """The spec of held-out evaluation's worker: `spec` decoding greedily, one sample per prompt,
    scored by `reward` (the run's reward function, even where a reward stage scores training),
    without partial rollouts."""
    greedy = replace(spec.sampling, temperature=0.0)
    return replace(spec, sampling=greedy, group_size=1, run_seed=0, reward=reward, partial=None)


def build_worker(
    spec: WorkerSpec,
    engine: Engine | None = None,
    tokenizer=None,
    reward: RewardScorer | None = None,
) -> tuple[EngineWeights | None, RolloutWorker]:
    """(what new weights load into, the worker) as `spec` describes: every rollout worker, in a
    worker process, colocated with the learner or evaluating, is built here.

    Without `engine` the worker opens its own (`spec.engine` over `spec.model_path`) and the
    weights are that engine's (`EngineWeights.load` copies into its model, or hands them to an
    engine that keeps its own copy). With `engine` (the learner's process: colocated generation,
    held-out evaluation) it decodes with that one, whose weights its holder brings (None).
    `tokenizer` saves loading the model's again; `reward`, what scores instead of `spec.reward`
    (reward processes beside a colocated worker). A chat environment whose template cannot
    carry tool calls raises `ChatToolsError`."""
    from cadence.engine import open_engine
    from cadence.envs import make_env
    from cadence.models import load_tokenizer
    from cadence.rewards import load_runner

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.model_path)
    weights = None
    if engine is None:
        engine, weights = open_engine(
            spec.engine,
            spec.model_path,
            tokenizer,
            spec.max_num_seqs,
            dtype=spec.dtype,
            device=spec.device,
            options=spec.engine_options,
        )
        if spec.adapter is not None:  # the engine keeps its base weights; versions are adapters
            weights = EngineAdapter(engine, spec.adapter)
    if reward is None and spec.reward:
        reward = load_runner(
            spec.reward, spec.answer_format, spec.reward_timeout_s, spec.reward_concurrency
        )
    worker = RolloutWorker(
        engine,
        tokenizer,
        reward,
        spec.sampling,
        spec.group_size,
        spec.run_seed,
        env=make_env(spec.env, tokenizer),
        partial=spec.partial,
    )
    return weights, worker
