"""The run configuration: TOML files validated by pydantic, with dotted `--set` overrides.

Every field has a description; an unknown key or a bad value raises `ConfigError`, whose message
names the key and what is allowed (the CLI turns it into exit code 2). Only the CLI and the run
builder see the whole config; components take plain keyword arguments.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field("runs/sft", description="Local Hugging Face causal-LM directory to train.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    device: str = Field("cpu", description="Torch device for learner and colocated engine.")


class DataConfig(_Section):
    task: Literal["arithmetic", "gsm8k"] = Field(
        "arithmetic", description="Task family: procedural arithmetic, or GSM8K-format JSONL."
    )
    path: str | None = Field(None, description="JSONL file for task 'gsm8k' (question/answer).")
    heldout_path: str | None = Field(
        None, description="Held-out JSONL for 'gsm8k'; default: the last num_heldout lines."
    )
    difficulty: int = Field(1, ge=1, le=3, description="Arithmetic difficulty, 1 (easiest)-3.")
    max_operand: int | None = Field(
        None, ge=2, description="Largest arithmetic operand (default: the difficulty's range)."
    )
    num_heldout: int = Field(200, ge=1, description="Held-out examples for accuracy.")
    prompt_template: str = Field(
        "Question: {question}\nAnswer: ", description="Prompt text; {question} is replaced."
    )
    on_bad_line: Literal["error", "skip"] = Field(
        "error", description="Malformed JSONL line: stop with file:line, or skip and count."
    )

    @model_validator(mode="after")
    def _path_for_gsm8k(self) -> DataConfig:
        if self.task == "gsm8k" and not self.path:
            raise ValueError("data.path is required when data.task = 'gsm8k'")
        return self


# vLLM arguments cadence sets itself (engine/vllm.py): not for rollout.vllm.engine_args
VLLM_RESERVED_ARGS = ("model", "tokenizer", "seed", "logprobs_mode", "max_num_seqs", "max_logprobs")


class VLLMConfig(_Section):
    """`[rollout.vllm]`: each key is the vLLM engine argument of the same name."""

    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of the GPU's memory vLLM takes (weights, activations, KV cache); "
        "lower it when the learner shares the GPU (placement 'colocated'). On CPU the KV cache "
        "is VLLM_CPU_KVCACHE_SPACE GiB instead (cadence's default: 1).",
    )
    enforce_eager: bool = Field(
        False,
        description="Run the model eagerly: no torch.compile, no CUDA graphs (a faster start, "
        "slower decoding on a GPU).",
    )
    max_model_len: int = Field(
        0, ge=0, description="Longest prompt + response vLLM plans for (0: the model's own)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations in vLLM (auto: model.dtype)."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the keys and values of whole blocks of a prompt across its G samples "
        "(emptied at each weight update).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine's model is split across (vLLM's own workers)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument by its name (e.g. block_size, "
        "kv_cache_dtype, swap_space), passed as given; checked when the engine starts.",
    )

    @model_validator(mode="after")
    def _no_owned_args(self) -> VLLMConfig:
        for key in self.engine_args:
            if key in VLLM_RESERVED_ARGS:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} is set by cadence (model path, per-sample "
                    "seeds, behaviour log-probs, rollout.max_num_seqs): leave it out"
                )
            if key in VLLMConfig.model_fields:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} has a key of its own: set rollout.vllm.{key}"
                )
        return self


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=1, description="Responses sampled per prompt (G).")
    max_new_tokens: int = Field(48, ge=1, description="Longest response, in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always).")
    max_prompt_tokens: int = Field(
        0, ge=0, description="Longest prompt, in tokens (0: no limit); see on_long_prompt."
    )
    on_long_prompt: Literal["skip", "truncate"] = Field(
        "skip",
        description="A prompt over max_prompt_tokens: skip it (the next example takes its place) "
        "or keep its last max_prompt_tokens tokens; counted as prompts_skipped / "
        "prompts_truncated in metrics.jsonl.",
    )
    max_num_seqs: int = Field(
        256, ge=1, description="Most sequences an engine decodes at once (its slots)."
    )
    engine: Literal["continuous", "static", "vllm"] = Field(
        "continuous",
        description="continuous: a finished sequence's slot is refilled at once and each group "
        "leaves as soon as it is complete; static: batches that end with their slowest sequence; "
        "vllm: vLLM's engine (paged attention, CUDA graphs, prefix cache, tensor parallelism), "
        "set up by [rollout.vllm]; needs the 'vllm' extra (README: engines).",
    )
    vllm: VLLMConfig = Field(
        default_factory=lambda: VLLMConfig(), description="engine 'vllm': its settings."
    )

    @model_validator(mode="after")
    def _vllm_keys_for_vllm(self) -> RolloutConfig:
        if self.engine != "vllm" and self.vllm != VLLMConfig():
            raise ValueError(
                f"rollout.vllm applies to rollout.engine = 'vllm' only, not '{self.engine}': "
                "set the engine or leave [rollout.vllm] out"
            )
        return self


class RewardConfig(_Section):
    kind: Literal["rule", "model"] = Field(
        "rule",
        description="rule: `function` scores each response; model: a learned reward model "
        "(`model_path`) scores responses in micro-batches of `batch_size`, in reward workers.",
    )
    function: str = Field(
        "math",
        description="'math' (math-verify final answer) or 'module:function'. With kind 'model' "
        "it still scores held-out accuracy.",
    )
    model_path: str | None = Field(
        None,
        description="kind 'model': local Hugging Face sequence-classification directory "
        "(`cadence init-reward-model` builds a tiny one on the task).",
    )
    stage: Literal["worker", "separate"] = Field(
        "worker",
        description="Where responses are scored: worker (inside the rollout worker, as each group "
        "finishes; rule rewards only) or separate (a stage of num_workers reward worker processes "
        "that score rows from the sample store as they arrive; needs pipeline.placement = "
        "'separate'). Default: worker for kind 'rule', separate for kind 'model'.",
    )
    num_workers: int = Field(1, ge=1, description="stage 'separate': reward worker processes.")
    threads_per_worker: int = Field(
        1, ge=1, description="stage 'separate': torch threads in each reward worker."
    )
    batch_size: int = Field(
        32,
        ge=1,
        description="stage 'separate': most responses a reward worker takes at once (it takes "
        "whatever has arrived, up to this); kind 'model': also responses per forward pass.",
    )
    max_error_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Stop the run when more samples than this fail scoring."
    )

    @model_validator(mode="before")
    @classmethod
    def _stage_of_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stage" not in data:
            data["stage"] = "separate" if data.get("kind") == "model" else "worker"
        return data

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


class AlgoConfig(_Section):
    loss: Literal["ppo_clip", "pg", "rloo", "online_dpo"] = Field(
        "ppo_clip",
        description="Loss (registry name): ppo_clip (clipped surrogate), pg (REINFORCE), rloo "
        "(REINFORCE with leave-one-out advantages), online_dpo (each group's best vs worst "
        "response, against the frozen reference).",
    )
    advantage: Literal["grpo", "rloo", "reinforce"] = Field(
        "grpo",
        description="Advantage estimator (registry name). With loss 'rloo' it must be 'rloo' "
        "(the default there); online_dpo uses none.",
    )
    scale_by_std: bool = Field(True, description="GRPO: divide by the group's reward std.")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO ratio floor is 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="PPO ratio ceiling is 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL(policy || reference).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    loss_agg: Literal["token-mean", "seq-mean", "seq-sum-norm"] = Field(
        "token-mean",
        description="Loss aggregation over the global batch (online_dpo: the mean over pairs).",
    )
    tis_cap: float = Field(
        0.0,
        ge=0.0,
        description="Truncated importance sampling: weigh each token's policy-gradient term by "
        "min(pi_old / pi_behaviour, tis_cap), pi_old the policy at the iteration's start and "
        "pi_behaviour the one that sampled; 0 turns it off, else >= 1.",
    )
    dpo_beta: float = Field(
        0.1, gt=0.0, description="online_dpo: beta of DPO (tau of IPO), the pull to the reference."
    )
    dpo_loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="online_dpo: sigmoid (DPO) or ipo (squared, IPO) pair loss."
    )

    @model_validator(mode="before")
    @classmethod
    def _rloo_advantage(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("loss") != "rloo":
            return data
        advantage = data.setdefault("advantage", "rloo")
        if advantage != "rloo":
            raise ValueError(
                f"algo.loss = 'rloo' computes leave-one-out advantages itself; "
                f"algo.advantage = {advantage!r} would be ignored: set it to 'rloo' or leave it out"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(
                f"algo.tis_cap must be 0 (off) or >= 1 (a cap below 1 shrinks the weight of "
                f"on-policy tokens); got {self.tis_cap}"
            )
        if self.loss == "online_dpo" and (self.kl_coef > 0 or self.tis_cap > 0):
            raise ValueError(
                "algo.loss = 'online_dpo' takes no algo.kl_coef or algo.tis_cap (dpo_beta pulls "
                "towards the reference; there is no importance ratio): set both to 0"
            )
        return self


class TrainConfig(_Section):
    iterations: int = Field(100, ge=1, description="Optimizer rounds (policy versions).")
    seed: int = Field(0, description="Run seed: data order, sampling seeds, initialisation.")
    prompts_per_iteration: int = Field(16, ge=1, description="Groups per iteration.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate.")
    warmup_iterations: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over the first N optimizer steps."
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    micro_batch_groups: int = Field(4, ge=1, description="Groups per forward/backward.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per iteration.")
    eval_every: int = Field(0, ge=0, description="Held-out eval every N iterations (0: ends).")
    threads: int = Field(0, ge=0, description="torch threads (0: all cores).")
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Write a checkpoint (policy, optimizer, RNG, data cursor, version, metrics "
        "offset) every N iterations and at the end, for `cadence train --resume`; 0: never.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    max_bad_steps: int = Field(
        3,
        ge=0,
        description="An optimizer step whose loss or gradient is NaN or inf is skipped (weights "
        "untouched) and counted; one more than this many in a row stops the run.",
    )


class LearnerConfig(_Section):
    shared_prompt: bool = Field(
        True,
        description="Pack each group as [prompt | r1 | ... | rG] so its prompt is computed once "
        "for its G responses (same log-probs as the unpacked forward).",
    )
    shared_prompt_impl: Literal["prefix", "dense"] = Field(
        "prefix",
        description="prefix: run the prompts once and let the responses attend to their keys and "
        "values (no quadratic mask; the faster); dense: one row per group with a 4-D mask.",
    )
    reuse_old_logprobs: bool = Field(
        True,
        description="Before an iteration's first optimizer step the old policy is the policy: use "
        "its log-probs detached instead of a pass of the frozen old copy.",
    )


class PipelineConfig(_Section):
    mode: Literal["sync", "periodic", "offpolicy"] = Field(
        "sync",
        description="sync: train once the whole batch is generated; periodic: train on groups as "
        "they finish, weights synced once per iteration (on-policy, same update as sync); "
        "offpolicy: generation runs up to max_staleness policy versions ahead of the learner.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="offpolicy: most versions a trained group may lag the learner (admission "
        "control: no prompt starts that could exceed it). 1 = one-step off-policy; 0 = periodic.",
    )
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: generate with the learner's own weights in its thread; "
        "separate: num_workers inference worker processes.",
    )
    num_workers: int = Field(1, ge=1, description="Inference worker processes (separate).")
    threads_per_worker: int = Field(1, ge=1, description="torch threads in each worker.")
    learner_threads: int = Field(
        0, ge=0, description="torch threads of the learner when separate (0: cores - workers)."
    )
    prompts_per_task: int = Field(
        4, ge=1, description="Prompts sent to a worker as one task (the unit of assignment)."
    )
    tasks_in_flight: int = Field(
        2, ge=1, description="Tasks queued at each worker at once (bounded concurrency)."
    )
    queue_size: int = Field(
        0,
        ge=0,
        description="periodic: most groups waiting in the sample store for the learner; while "
        "that many wait, the producer hands out no new task (0: no bound).",
    )
    worker_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for a worker to start or acknowledge weights."
    )
    max_worker_restarts: int = Field(
        3,
        ge=0,
        description="A worker process that dies is replaced (it loads the current weights and is "
        "sent again the prompts it had not returned) up to this many times per worker slot; one "
        "more death stops the run.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where separate workers run: local (spawned processes on this machine, "
        "shared-memory weights) or ray (Ray actors, on this machine or a cluster; needs the "
        "'ray' extra).",
    )
    ray_address: str | None = Field(
        None,
        description="ray: address of a running cluster to join ('auto', or 'HEAD_IP:6379'); "
        "unset: start a Ray on this machine for the run, listening on loopback only.",
    )
    ray_num_cpus: int = Field(
        0, ge=0, description="ray: CPUs the Ray started for the run offers (0: all cores)."
    )
    num_cpus_per_worker: float = Field(
        1.0, ge=0, description="ray: CPUs each worker actor reserves (Ray's num_cpus)."
    )
    num_gpus_per_worker: float = Field(
        0.0,
        ge=0,
        description="ray: GPUs each worker actor reserves (Ray's num_gpus); above 0 the worker "
        "generates on its GPU.",
    )
    weight_sync: Literal["object_store", "broadcast"] = Field(
        "object_store",
        description="ray: how a new version reaches the workers: object_store (put once into "
        "Ray's object store, every worker reads the same object) or broadcast (torch.distributed "
        "broadcast from the learner: NCCL when model.device is a GPU, gloo otherwise).",
    )

    @model_validator(mode="after")
    def _periodic_needs_workers(self) -> PipelineConfig:
        if self.mode in ("periodic", "offpolicy") and self.placement != "separate":
            raise ValueError(
                f"pipeline.mode = '{self.mode}' needs pipeline.placement = 'separate' "
                "(colocated generation cannot overlap with training)"
            )
        if self.queue_size and self.mode != "periodic":
            raise ValueError(
                "pipeline.queue_size bounds how far generation runs ahead of a streaming "
                f"learner: it applies to pipeline.mode = 'periodic' only, not '{self.mode}'"
            )
        if self.backend == "ray" and self.placement != "separate":
            raise ValueError(
                "pipeline.backend = 'ray' runs the inference workers as Ray actors: set "
                "pipeline.placement = 'separate'"
            )
        if self.backend == "local":
            for key in RAY_ONLY:
                if getattr(self, key) != PipelineConfig.model_fields[key].default:
                    raise ValueError(
                        f"pipeline.{key} applies to pipeline.backend = 'ray' only: set the "
                        f"backend or leave pipeline.{key} out"
                    )
        if self.ray_address and self.ray_num_cpus:
            raise ValueError(
                "pipeline.ray_num_cpus sizes the Ray started for the run; a cluster joined with "
                "pipeline.ray_address has its own: leave pipeline.ray_num_cpus out"
            )
        return self


RAY_ONLY = (
    "ray_address",
    "ray_num_cpus",
    "num_cpus_per_worker",
    "num_gpus_per_worker",
    "weight_sync",
)


class SFTConfig(_Section):
    base: str = Field("runs/base", description="Model directory SFT starts from.")
    out: str = Field("runs/sft", description="Where the SFT model is written (cached).")
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per step.")
    lr: float = Field(2e-3, gt=0.0, description="Peak learning rate (cosine decay).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")


class MetricsConfig(_Section):
    tensorboard: bool = Field(False, description="Also write TensorBoard event files.")
    progress: bool = Field(True, description="Live progress display on the console.")


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _reward_stage_needs_workers(self) -> Config:
        if self.reward.stage == "separate" and self.pipeline.placement != "separate":
            raise ValueError(
                "reward.stage = 'separate' (the default for reward.kind = 'model') scores in "
                "reward workers beside the rollout workers: set pipeline.placement = 'separate'"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_devices(self) -> Config:
        p = self.pipeline
        on_gpu = self.model.device.startswith("cuda")
        if p.weight_sync == "broadcast" and on_gpu and p.num_gpus_per_worker == 0:
            raise ValueError(
                f"pipeline.weight_sync = 'broadcast' with model.device = '{self.model.device}' "
                "broadcasts over NCCL, GPU to GPU: set pipeline.num_gpus_per_worker > 0 or use "
                "pipeline.weight_sync = 'object_store'"
            )
        return self


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"config key '{key}': {msg}")
    return "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """A TOML literal (number, bool, quoted string, list) or else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{p}' is not a section")
        node[leaf] = _parse_value(raw.strip())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from e
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to every run directory)."""
    out: list[str] = []
    for section, values in cfg.model_dump(exclude_none=True).items():
        _toml_table(section, values, out)
    return "\n".join(out)


def _toml_table(name: str, values: dict[str, Any], out: list[str]) -> None:
    """`[name]` with its plain keys, then each nested table as `[name.key]`."""
    out.append(f"[{name}]")
    out.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict))
    out.append("")
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_table(f"{name}.{k}", v, out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    import json

    return json.dumps(str(v))  # a JSON string is a valid TOML basic string
