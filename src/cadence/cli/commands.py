"""What each `cadence` command does (the parser is cli/args.py, exit codes cli/__init__.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cadence.config import Config, ConfigError, load_config


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.set)


def cmd_init_model(args: argparse.Namespace) -> int:
    if args.from_gguf:
        return _init_model_from_gguf(args)
    from cadence.builder import tokenizer_corpus
    from cadence.models import init_model

    cfg = load_config(args.config, args.set)
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        print(f"{out} already holds a model; pass --force to rebuild it")
        return 0
    corpus = tokenizer_corpus(cfg, args.corpus_size)
    preset = args.preset or "tiny"
    init_model(preset, out, corpus, seed=cfg.train.seed)
    print(f"built '{preset}' model and tokenizer in {out}")
    return 0


def _init_model_from_gguf(args: argparse.Namespace) -> int:
    """`init-model --from-gguf FILE`: the file's model as a Hugging Face directory."""
    from cadence.models import convert_gguf

    if args.config or args.set:  # they choose the tokenizer corpus of a preset; a GGUF has its own
        raise ConfigError("--config and --set apply to --preset, not to --from-gguf")
    start = time.perf_counter()
    r = convert_gguf(
        args.from_gguf,
        args.out,
        force=args.force,
        progress=lambda m: print(f"[{time.perf_counter() - start:5.1f}s] {m}", flush=True),
    )
    stops = ", ".join(map(str, r.stop_token_ids))
    print(
        f"converted in {r.seconds:.1f}s: {r.model_type}, {r.num_parameters:,} parameters (float32),"
        f" vocabulary {r.vocab_size:,}, EOS {r.eos_token!r} (stops at {stops}), chat template "
        f"{'saved' if r.chat_template else 'absent'} -> {r.out}"
    )
    return 0


def cmd_init_reward_model(args: argparse.Namespace) -> int:
    from cadence.builder import make_task, set_threads
    from cadence.rewards.model_recipe import train_reward_model

    cfg = load_config(args.config, args.set)
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        print(f"{out} already holds a model; pass --force to rebuild it")
        return 0
    set_threads(cfg.train.threads)
    r = train_reward_model(
        make_task(cfg),
        cfg.data.prompt_template,
        args.tokenizer or cfg.model.path,
        out,
        preset=args.preset,
        steps=args.steps,
        seed=cfg.train.seed,
    )
    print(
        f"reward model trained in {r['train_s']:.1f}s ({r['steps']} steps): held-out accuracy "
        f"{r['heldout_accuracy']:.3f}, pairwise {r['heldout_pairwise_accuracy']:.3f} -> {out}"
    )
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from cadence.builder import make_task, prompt_render, set_threads, sft_segments
    from cadence.choices import env_kind
    from cadence.learner.sft import cache_key, is_cached, run_sft
    from cadence.models import load_tokenizer
    from cadence.models.io import check_model_dir

    cfg = _config(args)
    s = cfg.sft
    base, out = Path(s.base), Path(s.out)
    check_model_dir(base)
    data = cfg.data.model_dump()
    if env_kind(cfg.env.kind).answers:  # the demonstrations differ (single-turn keys stay)
        data["env"] = cfg.env.model_dump()
    key = cache_key(s.model_dump(), data, cfg.train.seed, base)
    if is_cached(out, key) and not args.force:
        print(f"SFT model in {out} is up to date (cached); pass --force to retrain")
        return 0
    set_threads(cfg.train.threads)
    record = run_sft(
        make_task(cfg),
        prompt_render(cfg, load_tokenizer(base)),
        base,
        out,
        steps=s.steps,
        batch_size=s.batch_size,
        lr=s.lr,
        warmup_steps=s.warmup_steps,
        key=key,
        progress=cfg.metrics.progress,
        segments=sft_segments(cfg),
    )
    print(
        f"SFT done: {record['steps']} steps, loss {record['final_loss']:.3f}, "
        f"{record['wall_s']:.0f}s -> {out}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from cadence.builder import build_run, train
    from cadence.pipeline.checkpoint import find_checkpoint
    from cadence.pipeline.outputs import check_fresh

    if args.resume is None:
        if args.config is None:
            raise ConfigError("cadence train needs a CONFIG file (or --resume RUN_DIR)")
        cfg, out, ckpt = _config(args), Path(args.out or "runs/train"), None
        check_fresh(out)
    else:  # the run's own config (overrides apply on top), into the run's own directory
        ckpt = find_checkpoint(args.resume)
        run_dir = ckpt.path.parent.parent
        cfg = load_config(args.config or run_dir / "config.toml", args.set)
        out = Path(args.out) if args.out else run_dir
        if ckpt.iteration >= cfg.train.iterations:
            raise ConfigError(
                f"{ckpt.path} is at iteration {ckpt.iteration}: nothing left to run with "
                f"train.iterations = {cfg.train.iterations} (raise it with --set to go on)"
            )
        print(f"resuming from {ckpt.path} (iteration {ckpt.iteration}) into {out}")
    run = build_run(cfg, resume=ckpt)
    summary = train(run, out)
    print_summary(summary, out)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from cadence.builder import evaluate_model, set_threads

    cfg = _config(args)
    set_threads(cfg.train.threads)
    out = {"model": str(args.model_dir)} | evaluate_model(cfg, args.model_dir)
    if cfg.distill.paths:  # a distilled run's teachers, on the same problems, beside the student
        out["teachers"] = {path: evaluate_model(cfg, path) for path in cfg.distill.paths}
    print(json.dumps(out))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from cadence.bench import (
        bench,
        bench_ablation,
        bench_engine,
        bench_ranks,
        bench_shared_prompt,
        bench_trl,
        parse_modes,
    )
    from cadence.bench.modes import PARTIAL_SUITE
    from cadence.builder import set_threads

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1; got {args.repeats}")
    if args.iterations < 0:
        raise ConfigError(f"--iterations must be >= 0 (0: the config's); got {args.iterations}")
    if args.cells is not None and args.suite != "ablation":
        raise ConfigError(f"--cells applies to --suite ablation, not '{args.suite}'")
    if args.modes is not None and args.suite not in ("modes", "partial"):
        raise ConfigError(f"--modes applies to --suite modes or partial, not '{args.suite}'")
    if args.config is None:
        longtail = args.suite == "partial"
        args.config = "configs/bench-longtail.toml" if longtail else "configs/default.toml"
    load_config(args.config, args.set)  # fail early on a bad config, before any run starts
    if args.seeds is not None and args.suite != "race":
        raise ConfigError(f"--seeds applies to --suite race, not '{args.suite}'")
    if args.suite == "race":
        from cadence.bench.race import bench_race, bench_race_seeds

        out = Path(args.out)
        race = {
            "minutes": args.minutes,
            "every": args.snapshot_every,
            "iterations": args.iterations,
            "trl_threads": args.trl_threads,
        }
        if args.seeds is None:
            bench_race(args.config, list(args.set), out, **race)
            print((out / "race.md").read_text())
        else:
            from cadence.study import parse_seeds

            try:
                seeds = parse_seeds(args.seeds)
            except ValueError as e:
                raise ConfigError(f"cadence bench: --seeds: {e}") from None
            bench_race_seeds(args.config, list(args.set), out, seeds, **race)
            print((out / "races.md").read_text())
        return 0
    if args.suite == "engine":
        set_threads(load_config(args.config, args.set).train.threads)
        rows = bench_engine(Path(args.out), args.repeats, model_dir=args.model)
        print((Path(args.out) / "bench.md").read_text())
        return 0 if rows else 1
    if args.suite == "shared-prompt":
        rows = bench_shared_prompt(args.config, list(args.set), args.repeats, Path(args.out))
        print((Path(args.out) / "bench.md").read_text())
        return 0 if rows else 1
    if args.suite == "ranks":
        out = Path(args.out)
        rows = bench_ranks(args.config, list(args.set), args.repeats, out, args.iterations or 3)
        print((out / "bench.md").read_text())
        return 0 if rows else 1
    overrides = list(args.set) + (
        [f"train.iterations={args.iterations}"] if args.iterations else []
    )
    if args.suite in ("trl", "ablation"):
        if args.suite == "trl":
            bench_trl(args.config, overrides, args.repeats, Path(args.out))
        else:
            bench_ablation(args.config, overrides, args.repeats, Path(args.out), args.cells)
        print((Path(args.out) / "bench.md").read_text())
        return 0
    default = PARTIAL_SUITE if args.suite == "partial" else "sync-colocated,sync,periodic,offpolicy"
    try:
        names = parse_modes(args.modes or default)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rows = bench(args.config, overrides, names, args.repeats, Path(args.out))
    print((Path(args.out) / "bench.md").read_text())
    return 0 if rows else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from cadence.plan import load_spec, plan
    from cadence.plan.report import draw_plan, print_plan, write_json

    out = Path(args.out)
    if args.spec is not None and is_run_config(args.spec):
        return print_ledger(args.spec, args.set, args.gpu_memory_gb * 1e9, out)
    base = None
    if args.calibrate is not None:  # this machine, measured; the workload of --config
        from cadence.plan.calibrate import calibrate_to

        cfg = load_config(args.config)
        base = calibrate_to(cfg, args.calibrate or cfg.model.path, out, log=print)
    spec = load_spec(args.spec, args.set, base=base)
    result = plan(spec, log=print)
    console = Console()
    print_plan(result, console if console.is_terminal else Console(width=120))
    print(
        f"wrote {write_json(result, out / 'plan.json')} and {draw_plan(result, out / 'plan.png')}"
    )
    return 0


def is_run_config(path: str) -> bool:
    """Whether the TOML in `path` is a run's config (it has a run's sections) rather than a
    plan spec."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # the plan spec loader says what is wrong
    return bool({"rollout", "train", "learner", "pipeline", "algo", "data"} & set(data))


def print_ledger(config: str, overrides: list[str], gpu_bytes: float, out: Path) -> int:
    """`cadence plan CONFIG`: the run's memory ledger per GPU (plan/ledger.py), printed and
    written to ledger.md and ledger.json; exit 1 when a GPU's peak exceeds its memory."""
    from cadence.plan.ledger import ledger, ledger_table, over_memory
    from cadence.plan.shapes import model_shape

    cfg = load_config(config, overrides)
    if not cfg.model.device.startswith("cuda"):
        raise ConfigError(f"{config}: model.device = '{cfg.model.device}': no GPU to account for")
    gpus = ledger(cfg, model_shape(cfg.model.path), gpu_bytes)
    table = ledger_table(gpus, gpu_bytes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger.md").write_text(table + "\n")
    rows = [
        {"gpu": g.index, "roles": g.roles, "peak_bytes": g.peak, "buffers": g.buffers} for g in gpus
    ]
    (out / "ledger.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"memory per GPU of {config} ({gpu_bytes / 1e9:g} GB each):\n\n{table}")
    over = over_memory(gpus, gpu_bytes)
    if over:
        print(f"GPU(s) {over} would hold more than their memory")
    return 1 if over else 0


def cmd_study(args: argparse.Namespace) -> int:
    from cadence.study import LOSSES, parse_list, parse_seeds, study_offpolicy, study_seeds
    from cadence.study.offpolicy import VARIANTS

    overrides = list(args.set) + (
        [f"train.iterations={args.iterations}"] if args.iterations else []
    )
    out = Path(args.out)
    try:
        if args.study == "seeds":
            seeds = parse_seeds(args.seeds)
        else:
            losses = parse_list(args.losses, LOSSES, "loss(es)")
            staleness = [int(n) for n in parse_list(args.staleness, None, "staleness")]
            variants = tuple(parse_list(args.variants, VARIANTS, "variant(s)"))
    except ValueError as e:
        raise ConfigError(f"cadence study: {e}") from None
    if args.study == "seeds":
        config = args.config or "configs/default.toml"
        load_config(config, overrides)  # fail early on a bad config, before any run starts
        rows = study_seeds(config, overrides, seeds, out)
    else:
        if any(n < 0 for n in staleness):
            raise ConfigError(f"--staleness values must be >= 0; got {staleness}")
        config = args.config or "configs/study-offpolicy.toml"
        load_config(config, overrides)
        rows = study_offpolicy(config, overrides, losses, staleness, out, variants)
    print((out / "study.md").read_text())
    return 0 if rows else 1


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from cadence.builder import set_threads
    from cadence.models.io import check_model_dir
    from cadence.serve import build_server, check_binding, run

    token = args.token or os.environ.get("CADENCE_SERVE_TOKEN") or None
    try:
        check_binding(args.host, token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_model_dir(Path(args.model_dir))
    set_threads(args.threads)
    server = build_server(args.model_dir, args.max_num_seqs, args.max_tokens)
    print(f"cadence serve: {args.model_dir} on http://{args.host}:{args.port}/v1")
    run(server, args.host, args.port, token)
    return 0


def print_summary(summary: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cadence run: {out}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        (
            f"held-out accuracy before RL ({summary['num_heldout']} problems)",
            f"{summary['accuracy_before']:.3f} ± {summary['accuracy_before_stderr']:.3f}",
        ),
        (
            "held-out accuracy after RL",
            f"{summary['accuracy_after']:.3f} ± {summary['accuracy_after_stderr']:.3f}",
        ),
        (
            "reward (first -> last)",
            f"{summary['reward_mean_first']:.3f} -> {summary['reward_mean_last']:.3f}",
        ),
        ("KL to reference (last)", f"{summary['kl_last']:.4f}"),
        ("trained tokens", f"{summary['num_tokens']:,.0f}"),
        ("tokens computed by the learner", f"{summary['tokens_computed']:,.0f}"),
        ("positions computed (padding included)", f"{summary.get('positions_computed', 0):,.0f}"),
        ("TPSPD (tokens/s/device)", f"{summary['tpspd_overall']:,.0f}"),
        ("generation / training busy", f"{summary['gen_s']:.1f}s / {summary['train_s']:.1f}s"),
        ("RL wall time", f"{summary['wall_s']:.1f}s"),
        ("mode / placement", f"{summary['mode']} / {summary['placement']}"),
    ]
    rows[3:3] = _task_rows(summary)  # after the run's reward
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _task_rows(summary: dict) -> list[tuple[str, str]]:
    """Per task of a mix: reward first -> last, held-out accuracy before -> after."""
    rows = []
    nan = float("nan")
    for task in sorted(k.partition("/")[2] for k in summary if k.startswith("reward_mean_first/")):
        first, last = summary[f"reward_mean_first/{task}"], summary[f"reward_mean_last/{task}"]
        before = summary.get(f"accuracy_before/{task}", nan)  # not after a resume
        after = summary.get(f"accuracy_after/{task}", nan)
        value = f"{first:.3f} -> {last:.3f} / {before:.3f} -> {after:.3f}"
        rows.append((f"{task}: reward / held-out accuracy", value))
    return rows
