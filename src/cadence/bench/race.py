"""`cadence bench --suite race`: cadence and TRL's GRPOTrainer racing to one held-out accuracy.

Both tools train the workload of `--suite trl` (bench/trl_peer.py maps it: model, prompts, group
size, prompts per step, learning rate, adapter, response cap, reward) for the same wall-clock
budget (`--minutes`: `train.max_minutes` for cadence, a callback for TRL), one after the other,
each saving its policy every `--snapshot-every` optimizer steps and when the budget ends.
Afterwards, outside both clocks, every snapshot is scored by one evaluator (`cadence eval`'s:
greedy, the same held-out problems). A snapshot's training seconds leave out its saving; the
budget counts it, for both tools alike. Writes race.json, race.md and race.png and reports the
seconds each tool needs to reach the lower of the two final accuracies. With a `[distill]` teacher
both tools distil from it (TRL's `DistillationTrainer`) and the report adds the seconds each needs
to reach 90% of the teacher's accuracy. `--seeds` runs one race per `train.seed` (seed-N/) and
sums them up in races.json and races.md. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cadence.bench.common import machine, package_version, run_apart
from cadence.bench.runs import workload_config
from cadence.bench.trl_setup import INSTALL_HINT, Meter, available, check_workload, trl_trainer
from cadence.config import Config, ConfigError
from cadence.metrics import binomial_stderr
from cadence.metrics.tables import markdown_table as table

TOOLS = ("cadence", "trl")
STEP_CAP = 2000  # optimizer steps either tool may take inside the budget (--iterations: another)
OF_TEACHER = 0.9  # a distilling race's second target: this share of the teacher's accuracy


@dataclass
class Snapshot:
    step: int  # optimizer steps taken
    seconds: float  # training seconds up to it (its own saving left out)
    path: str
    accuracy: float = math.nan
    stderr: float = math.nan


def race_config(
    config: str | Path | None, overrides: list[str], minutes: float, iterations: int
) -> Config:
    """The race's workload: the config and overrides, at most `iterations` steps (0: STEP_CAP),
    stopped by `train.max_minutes`."""
    if minutes <= 0:
        raise ConfigError(f"--minutes must be > 0 for suite 'race'; got {minutes}")
    cap = iterations or STEP_CAP
    cfg = workload_config(
        config, [*overrides, f"train.iterations={cap}", f"train.max_minutes={minutes}"]
    )
    check_workload(cfg)
    return cfg


def race_cadence(cfg: Config, out: Path, every: int) -> list[Snapshot]:
    """cadence for `train.max_minutes`, its policy saved every `every` iterations and at the end."""
    from cadence.builder import build_run, train
    from cadence.models import save_pretrained

    run = build_run(cfg)
    snapshots: list[Snapshot] = []

    class Snapshots:  # a metrics sink: it sees each iteration's record as the iteration ends
        steps, seconds = 0, 0.0

        def write(self, record: dict) -> None:
            self.steps += 1
            self.seconds += record["wall_s"]  # the iteration itself, not the saves between
            if self.steps % every == 0:
                path = save_pretrained(run.trainer.model, run.tokenizer, out / f"step-{self.steps}")
                snapshots.append(Snapshot(self.steps, self.seconds, str(path)))

        def close(self) -> None:
            pass

    sink = Snapshots()
    train(run, out / "run", extra_sinks=[sink], evaluate=False)
    if not snapshots or snapshots[-1].step != sink.steps:  # the final policy, as train() wrote it
        snapshots.append(Snapshot(sink.steps, sink.seconds, str(out / "run" / "final")))
    return snapshots


def race_trl(cfg: Config, out: Path, every: int) -> list[Snapshot]:
    """TRL's GRPOTrainer for the same budget, saving the same way."""
    if not available():
        raise ConfigError(f"suite 'race' needs trl, which is not installed: {INSTALL_HINT}")
    from transformers import TrainerCallback

    from cadence.models import save_pretrained

    budget = 60 * cfg.train.max_minutes
    snapshots: list[Snapshot] = []

    class Race(TrainerCallback):
        begin = saving = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            spent = time.perf_counter() - self.begin  # the budget counts the saves
            over = spent >= budget or state.global_step >= args.max_steps
            if state.global_step % every == 0 or over:
                seconds = spent - self.saving  # the saves before this one left out
                start = time.perf_counter()
                path = save_pretrained(model, processing_class, out / f"step-{state.global_step}")
                self.saving += time.perf_counter() - start
                snapshots.append(Snapshot(state.global_step, seconds, str(path)))
            if over:
                control.should_training_stop = True

    trainer, _ = trl_trainer(cfg, out / "run", Meter(), callbacks=(Race(),))
    trainer.train()
    return snapshots


def evaluate_snapshots(cfg: Config, snapshots: list[Snapshot], log=print) -> None:
    """Each snapshot's held-out accuracy and standard error, by `cadence eval`'s evaluator."""
    from cadence.builder import evaluate_model

    for s in snapshots:
        result = evaluate_model(cfg, s.path)
        s.accuracy = result["accuracy"]
        s.stderr = binomial_stderr(s.accuracy, int(result["num_prompts"]))
        log(f"  step {s.step:4d} at {s.seconds:7.1f} s: held-out accuracy {s.accuracy:.3f}")


def seconds_to_reach(snapshots: list[Snapshot], target: float) -> float:
    """Training seconds of the first snapshot after the start whose accuracy reaches `target`
    (the last snapshot's accuracy is at least the lower final accuracy, so one always does)."""
    return next(s.seconds for s in snapshots if s.step > 0 and s.accuracy >= target - 1e-12)


def seconds_to_teacher(snapshots: list[Snapshot], target: float) -> float | None:
    """Training seconds to `target` (`OF_TEACHER` of the teacher's accuracy); None where no
    snapshot reaches it."""
    try:
        return seconds_to_reach(snapshots, target)
    except StopIteration:
        return None


def bench_race(
    config: str | Path | None,
    overrides: list[str],
    out: Path,
    minutes: float,
    every: int = 5,
    iterations: int = 0,
    trl_threads: int = 0,
) -> dict:
    """Both tools for `minutes` each, each in a process of its own with its torch threads
    (cadence `train.threads`, TRL `trl_threads` or the same), every snapshot evaluated;
    race.json, race.md, race.png."""
    if every < 1:
        raise ConfigError(f"--snapshot-every must be >= 1; got {every}")
    if not available():
        raise ConfigError(f"suite 'race' needs trl, which is not installed: {INSTALL_HINT}")
    cfg = race_config(config, overrides, minutes, iterations)
    threads = {"cadence": cfg.train.threads, "trl": trl_threads or cfg.train.threads}
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[Snapshot]] = {}
    for tool, race in (("cadence", race_cadence), ("trl", race_trl)):
        print(f"race: {tool} trains for {minutes:g} min", flush=True)
        train = cfg.train.model_copy(update={"threads": threads[tool]})
        # each in a process of its own: TRL run after cadence in cadence's process took about
        # 70 s a step where alone it took 53-56 (SmolLM2, 2 threads)
        curves[tool] = run_apart(race, cfg.model_copy(update={"train": train}), out / tool, every)
    print("race: evaluating every snapshot (outside both clocks)", flush=True)
    base = Snapshot(0, 0.0, cfg.model.path)
    evaluate_snapshots(cfg, [base])
    teachers = [Snapshot(0, 0.0, path) for path in cfg.distill.paths]  # cadence distils
    if teachers:
        print("race: the teachers cadence distils from", flush=True)
        evaluate_snapshots(cfg, teachers)
    for tool in TOOLS:
        print(f"race: {tool}", flush=True)
        evaluate_snapshots(cfg, curves[tool])
        curves[tool] = [base, *curves[tool]]
    report = race_report(cfg, curves, minutes, every)
    report["teachers"] = {t.path: t.accuracy for t in teachers}
    if teachers:  # one teacher: TRL's DistillationTrainer takes no more
        target = OF_TEACHER * teachers[0].accuracy
        report["teacher_target_accuracy"] = target
        report["seconds_to_teacher_target"] = {
            tool: seconds_to_teacher(curves[tool], target) for tool in TOOLS
        }
    report["trl_trainer"] = "DistillationTrainer" if teachers else "GRPOTrainer"
    report["threads"] = threads
    (out / "race.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "race.md").write_text(race_markdown(report) + "\n")
    draw_race(report, out / "race.png")
    return report


def bench_race_seeds(
    config: str | Path | None, overrides: list[str], out: Path, seeds: list[int], **race
) -> dict:
    """One race per seed (`train.seed`, for both tools) in `out`/seed-N, then races.json and
    races.md over them. A seed whose race.json is there already is read, not run again: a long
    study stopped part way resumes."""
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must name distinct seeds; got {seeds}")
    reports = {}
    for seed in seeds:
        done = out / f"seed-{seed}" / "race.json"
        if done.is_file():
            print(f"race: seed {seed} was raced already ({done})", flush=True)
            reports[seed] = json.loads(done.read_text())
            continue
        print(f"race: seed {seed}", flush=True)
        sets = [*overrides, f"train.seed={seed}"]
        reports[seed] = bench_race(config, sets, out / f"seed-{seed}", **race)
    summary = races_summary(reports)
    (out / "races.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "races.md").write_text(races_markdown(summary) + "\n")
    return summary


def races_summary(reports: dict[int, dict]) -> dict:
    """Per seed: both final accuracies, the target, each tool's seconds to it and the ratio;
    over the seeds: the ratio's least, median and greatest."""
    rows = [
        {
            "seed": seed,
            "final_accuracy": r["final_accuracy"],
            "target_accuracy": r["target_accuracy"],
            "seconds_to_target": r["seconds_to_target"],
            "ratio_trl_to_cadence": r["ratio_trl_to_cadence"],
            "steps": {tool: r["curves"][tool][-1]["step"] for tool in TOOLS},
            "threads": r.get("threads", {}),
        }
        for seed, r in reports.items()
    ]
    ratios = [row["ratio_trl_to_cadence"] for row in rows]
    spread = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
    return {"suite": "race", "seeds": rows, "ratio_trl_to_cadence": spread}


def races_markdown(summary: dict) -> str:
    header = ["seed", "steps (cadence / trl)", "final accuracy (cadence / trl)"]
    header += ["target", "s to target (cadence / trl)", "TRL / cadence"]
    cells = [
        [
            str(row["seed"]),
            " / ".join(str(row["steps"][tool]) for tool in TOOLS),
            " / ".join(f"{row['final_accuracy'][tool]:.3f}" for tool in TOOLS),
            f"{row['target_accuracy']:.3f}",
            " / ".join(f"{row['seconds_to_target'][tool]:.0f}" for tool in TOOLS),
            f"{row['ratio_trl_to_cadence']:.2f}x",
        ]
        for row in summary["seeds"]
    ]
    r = summary["ratio_trl_to_cadence"]
    return "\n".join(
        [
            table(header, cells),
            "",
            f"TRL takes {r['min']:.2f}x to {r['max']:.2f}x cadence's training seconds to the "
            f"lower final accuracy (median {r['median']:.2f}x) over {len(cells)} seeds; each "
            "seed's race is in seed-N/ (race.md, race.png).",
        ]
    )


def race_report(cfg: Config, curves: dict[str, list[Snapshot]], minutes: float, every: int):
    final = {tool: curves[tool][-1].accuracy for tool in TOOLS}
    target = min(final.values())
    reach = {tool: seconds_to_reach(curves[tool], target) for tool in TOOLS}
    return {
        "suite": "race",
        "minutes": minutes,
        "snapshot_every": every,
        "model_path": cfg.model.path,
        "task": cfg.data.task,
        "num_heldout": cfg.data.num_heldout,
        "seed": cfg.train.seed,
        "cadence_pipeline": {"mode": cfg.pipeline.mode, "placement": cfg.pipeline.placement},
        "curves": {tool: [asdict(s) for s in curves[tool]] for tool in TOOLS},
        "final_accuracy": final,
        "target_accuracy": target,
        "seconds_to_target": reach,
        # how many times longer TRL takes to the target (> 1: cadence gets there first)
        "ratio_trl_to_cadence": reach["trl"] / max(reach["cadence"], 1e-9),
        "trl_version": package_version("trl"),
        "machine": machine(),
    }


def race_markdown(report: dict) -> str:
    cells = []
    for tool in TOOLS:
        curve = report["curves"][tool]
        last = curve[-1]
        cells.append(
            [
                tool,
                str(last["step"]),
                f"{last['seconds']:.0f}",
                f"{curve[0]['accuracy']:.3f} -> {last['accuracy']:.3f} ± {last['stderr']:.3f}",
                f"{report['seconds_to_target'][tool]:.1f}",
            ]
        )
    header = ["tool", "steps", "training s", "held-out accuracy (± s.e.)", "s to target"]
    pipe = report["cadence_pipeline"]
    return "\n".join(
        [
            table(header, cells),
            "",
            f"Target: {report['target_accuracy']:.3f}, the lower final accuracy; TRL takes "
            f"{report['ratio_trl_to_cadence']:.2f}x cadence's training seconds to reach it. "
            f"Budget {report['minutes']:g} min each, snapshots every {report['snapshot_every']} "
            f"steps, {report['num_heldout']} held-out problems (greedy), seed {report['seed']}; "
            f"cadence {pipe['mode']} / {pipe['placement']}; trl {report['trl_version']}; "
            f"each tool in a process of its own{thread_words(report.get('threads', {}))}.",
            *teacher_lines(report),
        ]
    )


def thread_words(threads: dict[str, int]) -> str:
    if not threads:
        return ""
    return ", torch threads " + ", ".join(f"{t} {n or 'all'}" for t, n in threads.items())


def teacher_lines(report: dict) -> list[str]:
    """What a race with `[distill]` says of it: both tools distil, and when each reached 90% of
    the teacher."""
    teachers = report.get("teachers", {})
    if not teachers:
        return []
    named = ", ".join(f"{path} (held-out {acc:.3f})" for path, acc in teachers.items())
    reach = report["seconds_to_teacher_target"]
    when = "; ".join(
        f"{tool} {'not in the budget' if s is None else f'after {s:.0f} s'}"
        for tool, s in reach.items()
    )
    return [
        "",
        f"Both tools distil from {named} (TRL's DistillationTrainer: the exact reverse KL over "
        f"the vocabulary at each sampled token; cadence: the sampled one). "
        f"{OF_TEACHER:.0%} of the teacher ({report['teacher_target_accuracy']:.3f}): {when}.",
    ]


def draw_race(report: dict, path: Path) -> None:
    """Held-out accuracy against training seconds, one line per tool, standard-error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for tool, color in zip(TOOLS, ("tab:blue", "tab:gray"), strict=True):
        curve = report["curves"][tool]
        ax.errorbar(
            [s["seconds"] for s in curve],
            [s["accuracy"] for s in curve],
            yerr=[s["stderr"] for s in curve],
            color=color,
            marker="o",
            capsize=3,
            label=tool,
        )
    ax.axhline(report["target_accuracy"], color="tab:red", linestyle="--", label="target")
    for teacher, accuracy in report.get("teachers", {}).items():
        name = Path(teacher).name
        ax.axhline(accuracy, color="tab:green", linestyle=":", label=f"teacher {name}")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"race: {report['task']}, {report['minutes']:g} min each")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
