"""`[reward]`: the reward function or model, where it runs, its error budget, timeout and
concurrency, and DAPO's overlong shaping."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cadence.choices import ENGINES, ENV_KINDS
from cadence.config.base import Section


class RewardConfig(Section):
    kind: Literal["rule", "model"] = "rule"
    """rule: `function` scores each response; model: a learned reward model (`model_path`) scores
    responses in micro-batches of `batch_size`, in reward workers."""
    function: str = "math"
    """'math' (math-verify final answer), 'reasoning_gym' (each row's own reasoning-gym
    score_answer, in [0, 1]; the default when data.task = 'reasoning_gym') or 'module:function'
    (fn(prompt, completion, answer) -> float, or an `async def` one; a `metadata` keyword or
    **kwargs also gets the row's metadata). With kind 'model' it still scores held-out accuracy."""
    model_path: str | None = None
    """kind 'model': local Hugging Face sequence-classification directory (`cadence
    init-reward-model` builds a tiny one on the task)."""
    device: str = ""
    """kind 'model': where the reward model scores, 'cpu' or 'cuda' (the first GPU its reward
    worker sees: GPU 0 unless CUDA_VISIBLE_DEVICES narrows it); '': the run's, model.device."""
    stage: Literal["worker", "separate"] = "worker"
    """Where responses are scored: worker (inside the rollout worker, as each group finishes, in
    the engine's process; rule rewards only) or separate (num_workers reward worker processes:
    with pipeline.placement = 'separate' a stage that scores rows from the sample store as they
    arrive; colocated, rule rewards only, the processes score each group the learner's engine
    finishes while it decodes the others). Default: separate for kind 'model', and for
    rollout.engine = 'vllm' on a GPU (model.device 'cuda') with env.kind = 'single_turn' (an
    in-process vLLM shares its GIL with a reward computed beside it, and the GPU waits on it);
    worker otherwise."""
    num_workers: int = Field(1, ge=1)
    """stage 'separate': reward worker processes."""
    threads_per_worker: int = Field(1, ge=1)
    """stage 'separate': torch threads in each reward worker."""
    batch_size: int = Field(32, ge=1)
    """stage 'separate': most responses a reward worker takes at once (it takes whatever has
    arrived, up to this); kind 'model': also responses per forward pass."""
    max_error_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Stop the run (exit 1) when more reward calls than this fraction fail (raise, return NaN or
    time out): checked after each iteration once 64 calls were made, and at the end of the run
    however few; a run whose every call so far failed stops after its first iteration. 1
    tolerates every failure."""
    timeout_s: float = Field(10.0, ge=0.0)
    """Longest a rule reward call may take, in any process or thread: past it the call scores 0 and
    counts as a reward error (and in reward_timeouts); 0: no limit."""
    concurrency: int | None = Field(None, ge=1)
    """Most rule reward calls in flight at once in each process that scores (a rollout worker,
    held-out evaluation, each reward worker): an `async def` reward is awaited on one event loop
    per process, a plain one runs in threads (at 1, in the calling thread, as before). A group is
    scored while the engine decodes the others; results keep their order, so the values do not
    depend on it; each call keeps its own reward.timeout_s. Unset: the reward's own `concurrency`
    attribute (1 for 'math' and 'reasoning_gym', which compute rather than wait), else 32."""
    answer_format: Literal["hashes", "boxed", "last_number", "auto"] = "auto"
    """function 'math': the graded part of a completion and of the reference: the line after the
    last '####', the last \\boxed{...}, the last number, or auto (whichever of '####' and
    \\boxed{ comes last, else the whole text). A plain-number reference cuts the prediction to
    its last number. function 'reasoning_gym': auto is reasoning-gym's own rule, the last
    <answer>...</answer>; the others as for 'math' (no marker: no answer, score 0)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong penalty: over the last overlong_buffer tokens before the episode's cap
    on policy tokens (rollout.max_new_tokens single-turn; with tools the smaller of env.max_turns
    x rollout.max_new_tokens and env.max_total_tokens) a response's reward falls linearly by up
    to overlong_penalty. Counts the tokens the policy wrote, never tool replies. Applied by the
    learner before advantages, whatever the reward stage; reward_mean stays the raw reward,
    reward_shaped_mean is the shaped one. 0: off."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """The overlong penalty at the episode's cap (DAPO: 1)."""

    @model_validator(mode="before")
    @classmethod
    def _stage_of_kind(cls, data: Any) -> Any:
        """The default stage of the section alone (the whole config's also reads the engine:
        `default_stage`)."""
        if isinstance(data, dict) and "stage" not in data:
            data["stage"] = "separate" if data.get("kind") == "model" else "worker"
        return data

    @field_validator("device")
    @classmethod
    def _a_device(cls, device: str) -> str:
        if device and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise ValueError(
                f"{device!r} is not a device: 'cpu', 'cuda' or 'cuda:N' ('': the run's)"
            )
        return device

    @model_validator(mode="after")
    def _model_path_for_model(self) -> RewardConfig:
        if self.kind == "model" and not self.model_path:
            raise ValueError("reward.model_path is required when reward.kind = 'model'")
        if self.kind == "model" and self.stage != "separate":
            raise ValueError(
                "reward.kind = 'model' runs in reward workers: set reward.stage = 'separate' "
                "(or leave it out)"
            )
        return self


def default_stage(
    kind: str | None, engine: str | None, env_kind: str | None, device: str | None
) -> str:
    """reward.stage where unset: 'separate' for a reward model and for single-turn vLLM runs on
    a GPU (off the engine's GIL), 'worker' otherwise (on a CPU the engine's kernels hold the
    cores a reward process would take: no faster, measured)."""
    # read before the sections validate: an unknown name is refused by its own key later
    single_turn = env_kind not in ENV_KINDS or not ENV_KINDS[env_kind].answers
    gpu = (device or "cpu").startswith("cuda")
    holds_gil = engine in ENGINES and ENGINES[engine].gil_on_gpu
    return "separate" if kind == "model" or (holds_gil and single_turn and gpu) else "worker"
