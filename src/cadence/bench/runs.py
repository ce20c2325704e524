"""One timed cadence run, with the figures the `trl` and `ablation` suites report for every cell.

The figures are defined in bench/trl_peer.py's docstring, the same way for cadence and for TRL.
Here: wall time is the iterations' wall times back to back (`cadence train`'s own wall also holds
closing the workers and drawing timeline.png after the last step; it is kept as `loop_wall_s`),
busy times come from the run's spans, and every setting the run was given is read back from its
resolved config. This module builds and trains through the pipeline; it changes nothing in it.
"""

from __future__ import annotations

from pathlib import Path

from cadence.config import Config, load_config

# figures that get a median over repeats
FIGURES = (
    "tpspd",
    "wall_s",
    "loop_wall_s",
    "num_tokens",
    "gen_busy_s",
    "generate_s",
    "reward_s",
    "train_busy_s",
    "overlap_s",
    "idle_s",
    "tokens_computed",
    "forward_passes_per_microbatch",
    "prompt_tokens_mean",
    "response_tokens_mean",
    "reward_mean_first",
    "reward_mean_last",
)
# keys every run needs: no progress display, no held-out evaluation or checkpoint inside the loop
QUIET = ["metrics.progress=false", "train.eval_every=0", "train.checkpoint_every=0"]


def lora_setting(
    r: int, alpha: float, dropout: float, target_modules: list[str] | tuple[str, ...] | set[str]
) -> str:
    """A LoRA adapter's settings as one comparable string (targets sorted: peft keeps a set)."""
    targets = sorted(target_modules)
    return f"r={r}, alpha={float(alpha)}, dropout={float(dropout)}, targets={targets}"


def config_lora(cfg: Config) -> str:
    """The adapter `cfg` trains (`model.lora`), as `lora_setting` writes it; "off" without one."""
    lora = cfg.model.lora
    if lora is None:
        return "off"
    return lora_setting(lora.r, lora.alpha, lora.dropout, lora.target_modules)


def workload_config(config: str | Path | None, overrides: list[str]) -> Config:
    """The config of one benchmark run: the file, the overrides, then `QUIET`."""
    return load_config(config, [*overrides, *QUIET])


def run_cadence(cfg: Config, out: Path) -> dict:
    """One cadence RL run on `cfg` (built untimed, then timed over its iterations); the figures."""
    import torch

    from cadence.builder import build_run, learner_threads, train
    from cadence.metrics import MemorySink

    p = cfg.pipeline
    run = build_run(cfg)
    threads = (
        torch.get_num_threads()
        if p.placement == "colocated"
        else learner_threads(cfg) + p.num_workers * p.threads_per_worker
    )
    memory = MemorySink()  # metrics.jsonl appends: a reused directory would hold older runs
    summary = train(run, out, extra_sinks=[memory], evaluate=False)
    records = memory.records
    samples = cfg.train.prompts_per_iteration * cfg.rollout.group_size * len(records)
    response_tokens = sum(
        r["response_tokens_mean"] * cfg.train.prompts_per_iteration * cfg.rollout.group_size
        for r in records
    )
    # The iterations back to back; train()'s own wall also holds closing the workers and drawing
    # timeline.png after the last step, which TRL has no counterpart of.
    wall = sum(r["wall_s"] for r in records)
    gen, trn = summary["gen_s"], summary["train_s"]
    overlap = sum(r["overlap_s"] for r in records)
    t, r = cfg.train, cfg.rollout
    settings = {
        "model_path": str(Path(cfg.model.path).resolve()),
        "lora": config_lora(cfg),
        "prompts_per_step": t.prompts_per_iteration,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "lr": t.lr,
        "warmup_steps": t.warmup_iterations * t.mini_batches,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "kl_coef": cfg.algo.kl_coef,
        "clip_low": cfg.algo.clip_low,
        "clip_high": cfg.algo.clip_high,
        "micro_batch_sequences": t.micro_batch_groups * r.group_size,
        "optimizer_steps": int(sum(rec["optimizer_steps"] for rec in records)),
        "seed": t.seed,
        "threads": threads,
    }
    return {
        "tool": "cadence",
        "tpspd": summary["num_tokens"] / max(wall, 1e-9),
        "wall_s": wall,
        "loop_wall_s": summary["wall_s"],
        "num_tokens": summary["num_tokens"],
        "gen_busy_s": gen,
        "train_busy_s": trn,
        "overlap_s": overlap,
        "idle_s": max(wall - gen - trn + overlap, 0.0),
        "tokens_computed": summary["tokens_computed"],
        "forward_passes_per_microbatch": summary["forward_passes_per_microbatch"],
        "prompt_tokens_mean": (summary["num_tokens"] - response_tokens) / samples,
        "response_tokens_mean": response_tokens / samples,
        "reward_mean_first": records[0]["reward_mean"],
        "reward_mean_last": records[-1]["reward_mean"],
        "settings": settings,
    }
