"""TRL's `GRPOTrainer` set up to do the work a cadence config describes, and run with its clock.

`check_workload` refuses what TRL cannot run the way cadence does, `trl_args` maps the config to
`GRPOConfig` (beside `CPU_SETTINGS`, which keep TRL on the CPU path doing the same work), and
`run_trl` trains and reads back every figure the way cadence defines it (docs/benchmarks.md).
A config with a `[distill]` teacher gets TRL's `DistillationTrainer` instead (`distill_args`):
the same student, teacher, prompts and samples per step. The suites that compare the two
(`--suite trl`, `race`, the ablation grid) use this; trl is imported only inside `trl_trainer`.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cadence.bench.runs import lora_setting
from cadence.config import Config, ConfigError

INSTALL_HINT = "pip install 'cadence[bench]'"

TRL_LOSS = "ppo_clip"  # GRPOTrainer's loss: the clipped surrogate
# cadence algo.loss_agg -> the TRL loss_type with the same normaliser
LOSS_TYPES = {"token-mean": "dapo", "seq-mean": "grpo", "seq-sum-norm": "dr_grpo"}

# GRPOConfig arguments that keep TRL on the CPU path and make it do the same work as cadence
# (beyond the workload's own values, which `trl_args` maps from the config); checked against
# trl 1.16.0, the version pyproject.toml pins.
CPU_SETTINGS: dict[str, object] = {
    "use_vllm": False,  # generation with the policy's own `model.generate`
    "bf16": False,  # TRL's default is bf16 autocast; fp32 like cadence (bf16 is slower on CPU)
    "fp16": False,
    # TRL's default gradient_checkpointing=True recomputes activations (about 25% slower); the
    # name of transformers 5.19 (pinned for vLLM; 5.23 renames it activation_checkpointing)
    "gradient_checkpointing": False,
    "torch_compile": False,
    "optim": "adamw_torch",  # torch.optim.AdamW, as cadence (TRL's default is the fused kernel)
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "num_iterations": 1,  # one optimizer step per generated batch, as cadence's mini_batches=1
    "shuffle_dataset": False,  # prompts in cadence's order
    "top_k": 0,  # no top-k filter (cadence has none)
    "disable_dropout": False,
    "report_to": "none",
    "save_strategy": "no",
    "eval_strategy": "no",
    "logging_strategy": "no",  # rewards are read by this module, not from TRL's logs
    "disable_tqdm": True,
    "log_completions": False,
    "dataloader_num_workers": 0,
}

# settings read back from each tool; the two columns must agree
SHARED_SETTINGS = (
    "model_path",
    "lora",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "lr",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "kl_coef",
    "clip_low",
    "clip_high",
    "micro_batch_sequences",
    "optimizer_steps",
    "seed",
    "threads",
)


def available() -> bool:
    """Whether trl can be imported (without importing it)."""
    return importlib.util.find_spec("trl") is not None


def check_workload(cfg: Config) -> None:
    """Refuse a workload TRL's GRPOTrainer cannot run the way cadence does, naming each reason."""
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    problems = []
    if a.loss != TRL_LOSS:
        problems.append(f"algo.loss = '{a.loss}' (TRL's loss is the clipped one: '{TRL_LOSS}')")
    if a.advantage != "grpo":
        problems.append(f"algo.advantage = '{a.advantage}' (GRPOTrainer computes 'grpo')")
    if a.kl_coef > 0 and a.kl_estimator != "k3":
        problems.append(f"algo.kl_estimator = '{a.kl_estimator}' (TRL uses 'k3')")
    if a.scale_by_std and (a.std != "unbiased" or a.std_eps != 1e-4):
        problems.append(
            f"algo.std = '{a.std}', algo.std_eps = {a.std_eps} (TRL divides by the unbiased std "
            "plus 1e-4)"
        )
    if a.clip_ratio_c:
        problems.append(f"algo.clip_ratio_c = {a.clip_ratio_c} (TRL has no dual clip)")
    if a.kl_coef > 0 and a.kl_clamp:
        problems.append(f"algo.kl_clamp = {a.kl_clamp} (TRL does not cap k3)")
    if cfg.reward.overlong_buffer:
        problems.append(
            f"reward.overlong_buffer = {cfg.reward.overlong_buffer} (TRL shapes length with a "
            "reward function of its own)"
        )
    if t.mini_batches != 1:
        problems.append(f"train.mini_batches = {t.mini_batches} (compare with 1)")
    if t.prompts_per_iteration % t.micro_batch_groups:
        problems.append(
            f"train.prompts_per_iteration = {t.prompts_per_iteration} is not a multiple of "
            f"train.micro_batch_groups = {t.micro_batch_groups} (TRL accumulates whole "
            "micro-batches)"
        )
    if r.group_size < 2:
        problems.append(f"rollout.group_size = {r.group_size} (GRPOTrainer needs >= 2)")
    if r.temperature <= 0:
        problems.append("rollout.temperature = 0 (GRPOTrainer samples; use a temperature > 0)")
    if r.stop:
        problems.append(f"rollout.stop = {r.stop} (only EOS ends a TRL completion)")
    if cfg.model.dtype != "float32":
        problems.append(f"model.dtype = '{cfg.model.dtype}' (the comparison runs in float32)")
    problems += distill_problems(cfg)
    if problems:
        raise ConfigError(
            "the TRL peer cannot run this workload as cadence does: " + "; ".join(problems)
        )


def distill_problems(cfg: Config) -> list[str]:
    """What TRL's DistillationTrainer cannot do of a distilling config (none without a teacher)."""
    d = cfg.distill
    if not d.on:
        return []
    problems = []
    if d.teachers:
        problems.append("[[distill.teachers]] (TRL's DistillationTrainer takes one teacher)")
    if d.reward_coef:
        problems.append(f"distill.reward_coef = {d.reward_coef} (TRL distils without a reward)")
    if d.coef != 1.0:
        problems.append(f"distill.coef = {d.coef} (TRL's loss is the reverse KL itself: 1)")
    if cfg.algo.kl_coef:
        problems.append(f"algo.kl_coef = {cfg.algo.kl_coef} (TRL distils without a reference)")
    return problems


def trl_args(cfg: Config, out: Path) -> dict:
    """Every keyword argument given to `trl.GRPOConfig` for this workload."""
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    return {
        "output_dir": str(out),
        "num_generations": r.group_size,
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        # one optimizer step = prompts_per_iteration groups, in micro-batches of
        # micro_batch_groups groups; TRL counts completions, not prompts
        "per_device_train_batch_size": t.micro_batch_groups * r.group_size,
        "gradient_accumulation_steps": t.prompts_per_iteration // t.micro_batch_groups,
        "max_steps": t.iterations,
        "learning_rate": t.lr,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": t.warmup_iterations,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "beta": a.kl_coef,
        "epsilon": a.clip_low,
        "epsilon_high": a.clip_high,
        "loss_type": LOSS_TYPES[a.loss_agg],
        "scale_rewards": "group" if a.scale_by_std else "none",
        "mask_truncated_completions": a.mask_truncated,
        "seed": t.seed,
        "use_cpu": cfg.model.device == "cpu",
        **CPU_SETTINGS,
    }


def distill_args(cfg: Config, out: Path) -> dict:
    """Every keyword argument given to `trl.DistillationConfig` for a distilling workload: each
    prompt is a row repeated `group_size` times (TRL samples one completion a row), so a step
    trains on the same prompts and as many samples as cadence's; `beta = 1` is the reverse KL."""
    from trl import DistillationConfig

    grpo = trl_args(cfg, out)
    fields = DistillationConfig.__dataclass_fields__
    args = {k: v for k, v in grpo.items() if k in fields}  # num_generations, epsilon... go
    return args | {"beta": 1.0}


def trl_peft_config(cfg: Config):
    """The `peft.LoraConfig` TRL gets for the config's `model.lora` (None: every weight trains)."""
    lora = cfg.model.lora
    if lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def trained_lora(model) -> str:
    """The adapter a trained model carries, as `lora_setting` writes it; "off" without one."""
    from cadence.models.lora import is_lora

    if not is_lora(model):
        return "off"
    c = model.peft_config["default"]
    return lora_setting(c.r, c.lora_alpha, c.lora_dropout, c.target_modules)


# ----------------------------------------------------------------------------- TRL


@dataclass
class Meter:
    """What the wrapped TRL methods and callbacks record during one `trainer.train()`."""

    generate_s: list[float] = field(default_factory=list)
    reward_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    train_begin: float = 0.0
    train_end: float = 0.0
    step_begin: float = 0.0
    last_step_end: float = 0.0
    threads: int = 0
    num_tokens: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    num_samples: int = 0
    reward_means: list[float] = field(default_factory=list)
    reward_errors: int = 0

    def count(self, generated: tuple) -> None:
        prompt_ids, completion_ids = generated[0], generated[1]
        self.prompt_tokens += sum(len(p) for p in prompt_ids)
        self.response_tokens += sum(len(c) for c in completion_ids)
        self.num_tokens = self.prompt_tokens + self.response_tokens
        self.num_samples += len(completion_ids)


def _timed(fn: Callable, times: list[float], on_result: Callable | None = None) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)
        if on_result is not None:
            on_result(result)
        return result

    return wrapper


def _reward_fn(reward, meter: Meter) -> Callable:
    """cadence's reward (with its error handling: a failure scores 0) as a TRL reward function."""
    from cadence.rewards import safe_reward

    def cadence_reward(prompts, completions, answer, **kwargs) -> list[float]:
        triples = zip(prompts, completions, answer, strict=True)
        results = [safe_reward(reward, p, c, a) for p, c, a in triples]
        values = [res.value for res in results]
        meter.reward_errors += sum(res.error is not None for res in results)
        meter.reward_means.append(sum(values) / len(values))
        return values

    return cadence_reward


def _clock(meter: Meter):
    """A TRL/transformers callback that times the training loop and each optimizer step."""
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.threads = torch.get_num_threads()
            meter.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            meter.step_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            meter.last_step_end = time.perf_counter()
            meter.step_s.append(meter.last_step_end - meter.step_begin)

        def on_train_end(self, args, state, control, **kwargs):
            meter.train_end = time.perf_counter()

    return Clock()


def run_trl(cfg: Config, out: Path) -> dict:
    """One TRL GRPOTrainer run on the same workload as `run_cadence(cfg)`; the same figures."""
    if cfg.distill.on:
        raise ConfigError(
            "suite 'trl' compares GRPO steps; a [distill] config races TRL's DistillationTrainer "
            "in --suite race"
        )
    meter = Meter()
    trainer, args = trl_trainer(cfg, out, meter)
    trainer.train()
    return _trl_result(trainer, meter, args)


def trl_trainer(cfg: Config, out: Path, meter: Meter, callbacks: tuple = ()) -> tuple:
    """TRL's GRPOTrainer (DistillationTrainer for a distilling `cfg`) set up for `cfg`'s workload
    (its `train.iterations` steps' prompts), timed into `meter`; `callbacks` join the trainer's.
    Returns the trainer and its config's arguments."""
    check_workload(cfg)
    if not available():
        raise ConfigError(f"the TRL peer needs trl, which is not installed: {INSTALL_HINT}")
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from cadence.builder import make_task, prompt_render, set_threads
    from cadence.models import DTYPES, load_model, load_tokenizer
    from cadence.pipeline.prompts import PromptStream
    from cadence.rewards import load_reward

    t = cfg.train
    set_threads(t.threads)  # what a colocated cadence run uses
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device)
    stream = PromptStream(make_task(cfg), prompt_render(cfg, tokenizer), cfg.data.task)
    prompts = stream.next_batch(t.prompts_per_iteration * t.iterations)
    rows = [{"prompt": p.text, "answer": p.answer} for p in prompts]
    common = {
        "model": model,
        "processing_class": tokenizer,
        "peft_config": trl_peft_config(cfg),
        "callbacks": [_clock(meter), *callbacks],
    }
    if cfg.distill.on:
        from trl import DistillationConfig, DistillationTrainer

        args = distill_args(cfg, out)
        teacher = load_model(
            cfg.distill.teacher, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device
        )
        group = [row for row in rows for _ in range(cfg.rollout.group_size)]
        trainer = DistillationTrainer(
            teacher_model=teacher,
            args=DistillationConfig(**args),
            train_dataset=Dataset.from_list(group),
            **common,
        )
    else:
        args = trl_args(cfg, out)
        trainer = GRPOTrainer(
            reward_funcs=_reward_fn(
                load_reward(cfg.reward.function, cfg.reward.answer_format), meter
            ),
            args=GRPOConfig(**args),
            train_dataset=Dataset.from_list(rows),
            **common,
        )
        trainer._calculate_rewards = _timed(trainer._calculate_rewards, meter.reward_s)
    trainer.remove_callback(PrinterCallback)  # it would print TRL's end-of-training log
    trainer._generate = _timed(trainer._generate, meter.generate_s, meter.count)
    return trainer, args


def _trl_result(trainer, meter: Meter, args: dict) -> dict:
    a = trainer.args
    wall = meter.last_step_end - meter.train_begin  # as cadence's: up to the last step's end
    gen = sum(meter.generate_s) + sum(meter.reward_s)
    steps = sum(meter.step_s)
    settings = {
        "model_path": str(Path(trainer.model.config._name_or_path).resolve()),
        "lora": trained_lora(trainer.model),
        "prompts_per_step": a.generation_batch_size // a.num_generations,
        "group_size": a.num_generations,
        "max_new_tokens": a.max_completion_length,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "lr": a.learning_rate,
        "warmup_steps": a.warmup_steps,
        "weight_decay": a.weight_decay,
        "max_grad_norm": a.max_grad_norm,
        "kl_coef": a.beta,
        "clip_low": a.epsilon,
        "clip_high": a.epsilon_high,
        "micro_batch_sequences": a.per_device_train_batch_size,
        "optimizer_steps": trainer.state.global_step,
        "seed": a.seed,
        "threads": meter.threads,
    }
    return {
        "tool": "trl",
        "tpspd": meter.num_tokens / max(wall, 1e-9),
        "wall_s": wall,
        "loop_wall_s": meter.train_end - meter.train_begin,
        "num_tokens": meter.num_tokens,
        "gen_busy_s": gen,
        "generate_s": sum(meter.generate_s),
        "reward_s": sum(meter.reward_s),
        "train_busy_s": max(steps - gen, 0.0),
        "overlap_s": 0.0,
        "idle_s": max(wall - steps, 0.0),
        "tokens_computed": None,  # TRL does not report it: every sample repeats its prompt
        "forward_passes_per_microbatch": None,
        "prompt_tokens_mean": meter.prompt_tokens / max(meter.num_samples, 1),
        "response_tokens_mean": meter.response_tokens / max(meter.num_samples, 1),
        "reward_mean_first": meter.reward_means[0],
        "reward_mean_last": meter.reward_means[-1],
        "reward_errors": meter.reward_errors,
        "trl_num_input_tokens_seen": int(trainer.state.num_input_tokens_seen),
        "settings": settings,
        "grpo_config": args,
    }
