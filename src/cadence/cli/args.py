"""The `cadence` command line's arguments: one subcommand per `cmd_*` of cli/commands.py."""

from __future__ import annotations

import argparse

from cadence.cli.commands import (
    cmd_bench,
    cmd_eval,
    cmd_init_model,
    cmd_init_reward_model,
    cmd_plan,
    cmd_serve,
    cmd_sft,
    cmd_study,
    cmd_train,
)

DESCRIPTION = "`cadence` command line: init-model, sft, train, eval, serve, and the measurements."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cadence", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser, required: bool = True) -> None:
        if required:
            sp.add_argument("config", help="TOML config file")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set train.iterations=10",
        )

    sp = sub.add_parser(
        "init-model",
        help="build the embedded default model and tokenizer, or convert a GGUF file",
    )
    source = sp.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help="model size: test, tiny (default), small")
    source.add_argument(
        "--from-gguf",
        default=None,
        metavar="FILE",
        help="convert this GGUF file (llama.cpp's format) to a float32 Hugging Face directory",
    )
    sp.add_argument("--out", required=True, help="output model directory")
    sp.add_argument("--config", default=None, help="config whose [data] task trains the tokenizer")
    sp.add_argument("--corpus-size", type=int, default=20000, help="texts to train the tokenizer")
    sp.add_argument("--force", action="store_true", help="rebuild even if --out holds a model")
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_init_model)

    sp = sub.add_parser("init-reward-model", help="train a tiny reward model on the task")
    sp.add_argument("--out", required=True, help="output reward model directory")
    sp.add_argument("--config", default=None, help="config whose [data] task gives the samples")
    sp.add_argument(
        "--tokenizer", default=None, help="model directory whose tokenizer to share (model.path)"
    )
    sp.add_argument("--preset", default="test", help="model size: test, tiny, small")
    sp.add_argument("--steps", type=int, default=400, help="training steps of 32 texts")
    sp.add_argument("--force", action="store_true", help="rebuild even if --out holds a model")
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_init_reward_model)

    sp = sub.add_parser("sft", help="supervised warm start on reference solutions (cached)")
    with_config(sp)
    sp.add_argument("--force", action="store_true", help="retrain even if cached")
    sp.set_defaults(fn=cmd_sft)

    sp = sub.add_parser("train", help="RL training")
    sp.add_argument("config", nargs="?", default=None, help="TOML config file")
    with_config(sp, required=False)
    sp.add_argument(
        "--out", default=None, help="run output directory (default runs/train; with --resume, RUN)"
    )
    sp.add_argument(
        "--resume",
        default=None,
        metavar="RUN",
        help="continue the run in directory RUN from its newest checkpoint (or from the "
        "checkpoint directory RUN), with its own config.toml unless CONFIG is given",
    )
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("bench", help="measurements side by side (modes, layouts, TRL, ablation)")
    sp.add_argument(
        "--suite",
        default="modes",
        choices=["modes", "shared-prompt", "engine", "trl", "ablation", "ranks", "partial", "race"],
        help="modes: the RL workload in each pipeline mode; shared-prompt: one training "
        "iteration with the prompt shared or not; engine: static vs continuous batching vs "
        "model.generate on long-tailed and uniform response lengths; trl: cadence and TRL's "
        "GRPOTrainer on the same workload; ablation: pipeline x shared prompt x old-logprob "
        "reuse, plus TRL; ranks: one learner process against learner.ranks ranks (time, memory); "
        "partial: a long-tailed workload (configs/bench-longtail.toml) in sync, periodic, "
        "offpolicy and offpolicy with partial rollouts; race: cadence and TRL for the same "
        "minutes each, held-out accuracy against training seconds (race.json, race.md, race.png)",
    )
    sp.add_argument(
        "--minutes",
        type=float,
        default=20.0,
        help="suite 'race': each tool's wall-clock budget, in minutes",
    )
    sp.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="suite 'race': TRL's torch threads (0: train.threads, as cadence's); each tool "
        "runs in a process of its own",
    )
    sp.add_argument(
        "--seeds",
        default=None,
        help="suite 'race': one race per train.seed (comma-separated), each in OUT/seed-N, "
        "summed up in races.json and races.md; a seed already raced is read, not run again",
    )
    sp.add_argument(
        "--snapshot-every",
        type=int,
        default=5,
        help="suite 'race': save each tool's policy every N optimizer steps (and at the end)",
    )
    sp.add_argument(
        "--model",
        default=None,
        help="model directory for suite 'engine' (default: a fresh random-init 'tiny' model)",
    )
    sp.add_argument(
        "--modes",
        default=None,
        help="comma-separated: sync-colocated, sync, periodic, offpolicy, partial, "
        "partial-recompute (suite 'modes', default: the first four; suite 'partial', default: "
        "sync, periodic, offpolicy, partial)",
    )
    sp.add_argument(
        "--out", required=True, help="output directory (bench.json, bench.md; ablation: bench.png)"
    )
    sp.add_argument(
        "--config",
        default=None,
        help="workload config (default: configs/bench-longtail.toml for suite 'partial', "
        "configs/default.toml for the others)",
    )
    sp.add_argument("--repeats", type=int, default=3, help="repeats per mode (median)")
    sp.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="iterations (optimizer steps) per run, suites modes, trl, ablation (0: config); "
        "suite race: the most steps either tool may take in its minutes (0: 2000)",
    )
    sp.add_argument(
        "--cells",
        default=None,
        help="suite 'ablation': comma-separated cells to run instead of the whole grid, e.g. "
        "'sync-colocated/share/reuse,periodic/share/reuse,trl'",
    )
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_bench)

    sp = sub.add_parser("plan", help="predict each mode's speed on a cluster; recommend a split")
    sp.add_argument(
        "spec",
        nargs="?",
        default=None,
        help="plan TOML (default: the 7B example in docs/planner.md); or a run's config "
        "(configs/*.toml): what each GPU of that run holds, buffer by buffer",
    )
    sp.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=80.0,
        help="a run config's ledger: each GPU's memory, GB (default 80: an H100)",
    )
    sp.add_argument(
        "--calibrate",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL_DIR",
        help="measure this machine with the real engine and learner on MODEL_DIR (default: "
        "the --config model) and plan the --config workload on it",
    )
    sp.add_argument(
        "--config", default="configs/default.toml", help="training config (with --calibrate)"
    )
    sp.add_argument("--out", default="runs/plan", help="output directory (plan.json, plan.png)")
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("study", help="experiments over many runs (offpolicy, seeds)")
    sp.add_argument(
        "study",
        choices=["offpolicy", "seeds"],
        help="offpolicy: losses x staleness bound; seeds: the config over several seeds",
    )
    sp.add_argument("--losses", default="grpo,rloo,online_dpo", help="comma-separated losses")
    sp.add_argument("--staleness", default="0,1,2,4,8", help="comma-separated N (0: periodic)")
    sp.add_argument(
        "--variants",
        default="plain",
        help="offpolicy: comma-separated plain, partial (pipeline.partial_rollout), "
        "partial-corrected (and algo.rollout_correction = 'sequence_mask'); the partial ones "
        "for N >= 1",
    )
    sp.add_argument("--seeds", default="0,1,2", help="seeds: comma-separated train.seed values")
    sp.add_argument("--out", required=True, help="output directory (study.json, study.png)")
    sp.add_argument(
        "--config",
        default=None,
        help="workload config (default: configs/study-offpolicy.toml for offpolicy, "
        "configs/default.toml for seeds)",
    )
    sp.add_argument("--iterations", type=int, default=0, help="iterations per run (0: config)")
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_study)

    sp = sub.add_parser(
        "serve", help="an OpenAI-compatible chat-completions endpoint over a model directory"
    )
    sp.add_argument("model_dir", help="local Hugging Face causal-LM directory")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    sp.add_argument("--port", type=int, default=8000, help="port to bind")
    sp.add_argument(
        "--token",
        default=None,
        help="bearer token every request must carry (default: $CADENCE_SERVE_TOKEN); needed "
        "unless bound to loopback",
    )
    sp.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded at once")
    sp.add_argument("--max-tokens", type=int, default=256, help="most tokens per completion")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("eval", help="held-out accuracy of a model directory")
    sp.add_argument("model_dir")
    sp.add_argument("--config", default=None, help="TOML config (task, rollout settings)")
    with_config(sp, required=False)
    sp.set_defaults(fn=cmd_eval)
    return p
