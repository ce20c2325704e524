"""The whole configuration: one field per section, the few rules that set a default from another
section, and the cross-section checks (config/checks.py) run from one validator."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from cadence.choices import env_kind
from cadence.config.algo import AlgoConfig
from cadence.config.base import Section
from cadence.config.checks import check_all
from cadence.config.data import DataConfig
from cadence.config.distill import DistillConfig
from cadence.config.env import EnvConfig
from cadence.config.model import ModelConfig
from cadence.config.reward import RewardConfig, default_stage
from cadence.config.rollout import RolloutConfig
from cadence.config.train import (
    LearnerConfig,
    MetricsConfig,
    PipelineConfig,
    SFTConfig,
    TrainConfig,
)


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy: a local Hugging Face causal-LM directory, its dtype and device, and optionally a
    LoRA adapter (docs/data.md)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where prompts and reference answers come from: the procedural arithmetic task, GSM8K-format
    rows or any local data set; the held-out split; prompt rendering and chat templates
    (docs/data.md)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling: group size, response length, temperature, stop strings, the engine that generates
    (continuous, static, vLLM) and its settings (docs/engines.md)."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Scoring: a rule function or a learned reward model, where it runs (inside the rollout worker
    or as a separate stage), its error budget and timeout, and DAPO's overlong shaping
    (docs/data.md, docs/pipeline.md)."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The RL objective: advantage estimator, loss, clipping, KL to the reference, aggregation,
    importance-sampling correction, online DPO (docs/algorithms.md)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The optimisation: iterations, prompts per iteration, AdamW, micro-batches, held-out
    evaluation, threads, checkpoints and bad-step tolerance."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """How the learner computes: shared-prompt packing, old-logprob reuse (docs/learner.md), and
    learner ranks with FSDP2 or DDP (docs/ranks.md)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """How generation and training overlap: the mode (sync, periodic, offpolicy), placement,
    workers, dynamic sampling, worker recovery, and the Ray backend (docs/pipeline.md,
    docs/ray.md)."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation: a teacher's log-probs of the student's sampled tokens as the
    advantage, one teacher or one per task (docs/distillation.md)."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """What a sample is: one response, a multi-turn episode with tools, or an episode of a verifiers
    environment (docs/envs.md)."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """`cadence sft`: the supervised warm start on the task's reference solutions, cached by its
    settings."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Where figures go besides metrics.jsonl: the console, TensorBoard, Weights & Biases, MLflow
    (docs/outputs.md)."""

    @model_validator(mode="before")
    @classmethod
    def _reasoning_gym_reward(cls, data: Any) -> Any:
        """reasoning-gym rows are scored by their own datasets unless reward.function is set."""
        if not isinstance(data, dict):
            return data
        if _key(data, "data", "task") == "reasoning_gym":
            reward = data.setdefault("reward", {})
            if isinstance(reward, dict):
                reward.setdefault("function", "reasoning_gym")
        return data

    @model_validator(mode="before")
    @classmethod
    def _reward_stage(cls, data: Any) -> Any:
        """reward.stage, unset, follows the reward's kind, the engine and the environment
        (`default_stage`)."""
        if not isinstance(data, dict) or not isinstance(data.get("reward", {}), dict):
            return data
        reward = data.setdefault("reward", {})
        if "stage" not in reward:
            engine, env_kind = _key(data, "rollout", "engine"), _key(data, "env", "kind")
            device = _key(data, "model", "device")
            reward["stage"] = default_stage(reward.get("kind"), engine, env_kind, device)
        return data

    @property
    def max_policy_tokens(self) -> int:
        """The most tokens the policy writes in one episode: the cap of the overlong penalty and
        of seq-sum-norm's constant. Single-turn, rollout.max_new_tokens; with tools, each of at
        most env.max_turns turns writes at most rollout.max_new_tokens, and everything after the
        prompt (tool replies too) fits env.max_total_tokens, so the smaller of the two (for
        verifiers, which enforces its own limits, the two as stated: check_overlong_buffer_fits
        asks for them before a penalty shapes its episodes)."""
        r, e = self.rollout, self.env
        if not env_kind(e.kind).answers:
            return r.max_new_tokens
        return min(e.max_turns * r.max_new_tokens, e.max_total_tokens)

    @property
    def response_budget(self) -> tuple[int, str]:
        """(the most tokens after the prompt, the key that sets them): rollout.max_new_tokens, or
        with an environment the whole episode (env.max_total_tokens: turns and tool replies)."""
        if env_kind(self.env.kind).answers:
            return self.env.max_total_tokens, "env.max_total_tokens"
        return self.rollout.max_new_tokens, "rollout.max_new_tokens"

    @model_validator(mode="after")
    def _checks(self) -> Config:
        """The checks across sections (config/checks.py), in order: the first to fail names its
        keys."""
        check_all(self)
        return self


def _key(data: dict, section: str, key: str) -> Any:
    """`data[section][key]`, the section a dict or a built section (None where unset)."""
    value = data.get(section)
    if isinstance(value, dict):
        return value.get(key)
    return getattr(value, key, None)
