"""A run's outputs in its `--out` directory, and what a resumed run picks up from it.

Sinks and trackers (metrics.jsonl, the console, TensorBoard, W&B, MLflow), checkpoints, the
final model, summary.json, curves.png, trace.json and timeline.png: the loop (loop.py) calls
these and decides nothing here; none of them decides anything about training. docs/outputs.md.
"""

from __future__ import annotations

import json
import logging
import shutil
import tomllib
from pathlib import Path
from typing import Any, Protocol

from cadence.metrics import ConsoleProgress, JsonlSink, MetricsSink, TensorBoardSink, summary
from cadence.metrics.curves import draw_curves
from cadence.metrics.files import atomic_write, is_disk_full, writing
from cadence.metrics.tasks import task_summary
from cadence.metrics.timeline import draw_timeline, write_chrome_trace
from cadence.metrics.trackers import MlflowSink, WandbSink
from cadence.models import save_pretrained
from cadence.models.lora import save_merged
from cadence.pipeline.checkpoint import RunState, rng_state, save_checkpoint, set_rng_state
from cadence.pipeline.checkpoint_files import (
    CHECKPOINTS,
    CheckpointError,
    list_checkpoints,
    remove_stale_temporaries,
)
from cadence.pipeline.run import LoopParams, Run

log = logging.getLogger(__name__)


class Tracker(MetricsSink, Protocol):
    """An experiment tracker: a metrics sink that also gets the run's end (its summary and
    files, or None when the run failed)."""

    def finish(self, summary: dict[str, Any] | None, out: Path) -> None: ...


def open_trackers(p: LoopParams, out: Path) -> list[Tracker]:
    """The experiment trackers asked for (metrics.wandb, metrics.mlflow), started."""
    config = tomllib.loads(p.config_toml) if p.config_toml else {}
    trackers: list[Tracker] = []
    try:
        if p.wandb:
            trackers.append(WandbSink(out, config))
        if p.mlflow:
            trackers.append(MlflowSink(out, config))
    except BaseException:
        for t in trackers:
            t.finish(None, out)
        raise
    return trackers


def open_sinks(run: Run, out: Path, extra: list[MetricsSink]) -> list[MetricsSink]:
    """metrics.jsonl, the sinks given, TensorBoard if asked for, and the console."""
    p = run.params
    sinks: list[MetricsSink] = [JsonlSink(out / "metrics.jsonl"), *extra]
    if p.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    sinks.append(ConsoleProgress(p.iterations, enabled=p.progress, done=run.first_iteration))
    return sinks


def begin(run: Run, out: Path, evaluate: bool) -> RunState | None:
    """Where a resumed run stands (its checkpoint's state: metrics.jsonl cut back to it, the RNG
    continued), or None for a fresh one (a finished run's outputs go). Either way, what a
    process that died while writing left behind goes first."""
    for p in remove_stale_temporaries(out):
        log.warning("cadence: removed %s, left by a run that stopped while writing it", p)
    if run.resume is None:
        start_fresh(out)
        return None
    state = run.resume.run
    with (out / "metrics.jsonl").open("r+b") as f:
        f.truncate(state.metrics_bytes)
    set_rng_state(state.rng)
    return state


def check_fresh(out: Path) -> None:
    """Refuse to start a run where an unfinished one's checkpoints would be overwritten."""
    if list_checkpoints(out) and not (out / "summary.json").exists():
        raise CheckpointError(
            f"{out} holds checkpoints of a run that did not finish: continue it with "
            f"`cadence train --resume {out}`, or remove {out / CHECKPOINTS} (or pick another "
            "--out) to start over"
        )


def start_fresh(out: Path) -> None:
    """Clear a finished run's outputs from `out`; refuse to bury an unfinished one's."""
    check_fresh(out)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    for name in ("metrics.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)


def checkpoint(
    run: Run,
    out: Path,
    iteration: int,
    records: list,
    accuracy_before: float,
    tasks_before: dict[str, float],
) -> None:
    """Save the state after `iteration` iterations (see pipeline/checkpoint.py)."""
    cursor, pending = run.stream.position(iteration - run.first_iteration)
    state = RunState(
        cursor=cursor,
        pending_batches=pending,
        behaviour_policies=run.source.behaviour_policies(iteration),
        metrics_bytes=(out / "metrics.jsonl").stat().st_size,
        records=records,
        accuracy_before=accuracy_before,
        tasks_before=tasks_before,
        rng=rng_state(),
        reference_path=run.params.reference_path,
        reference_digest=run.reference_digest,
    )
    with run.tracer.span("checkpoint", "learner"):
        save_checkpoint(
            out,
            iteration,
            run.trainer,
            run.scorer,
            run.tokenizer,
            state,
            run.params.keep_checkpoints,
        )


def close_run(
    run: Run, out: Path, sinks: list[MetricsSink], error: BaseException | None, timeline: bool
) -> None:
    """Close the sinks, the trainer's ranks (if any) and the source (which stops the workers),
    then write the timeline. Every step runs whatever the others do. While `error` propagates, a
    failure here is logged in one line (not at all if both are the same full disk) rather than
    put in its place."""
    steps = [*(s.close for s in sinks), run.close]
    if timeline:
        steps.append(lambda: write_timeline(run, out))
    first: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as e:
            if error is None:
                first = first or e
            elif not (is_disk_full(e) and is_disk_full(error)):
                log.warning("cadence: while stopping: %s: %s", type(e).__name__, e)
    if first is not None:
        raise first


def write_final(run: Run, out: Path) -> None:
    """`final/`: the policy as trained (LoRA: the adapter; and final/merged/ when asked)."""
    with writing(out / "final"):
        save_pretrained(run.trainer.model, run.tokenizer, out / "final")
        if run.params.save_merged:
            save_merged(run.trainer.model, run.tokenizer, out / "final" / "merged")


def write_summary(
    run: Run,
    out: Path,
    records: list[dict[str, Any]],
    accuracy: tuple[float, float],
    tasks: tuple[dict[str, float], dict[str, float]],
    loop_s: float,
) -> dict[str, Any]:
    """summary.json and curves.png from the records and the held-out accuracy (before, after),
    overall and per task; returns the summary."""
    p = run.params
    before, after = accuracy
    result = summary(
        records, before, after, loop_s, run.num_heldout, mode=p.mode, placement=p.placement
    )
    draw_curves(
        records,
        out / "curves.png",
        before=(before, result["accuracy_before_stderr"]),
        after=(after, result["accuracy_after_stderr"]),
        title=f"cadence {p.mode} / {p.placement}",
    )
    result |= task_summary(records, *tasks)
    result["bad_lines_skipped"] = run.stream.bad_lines_skipped
    return result


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2) + "\n")


def write_timeline(run: Run, out: Path, last_iterations: int = 3) -> None:
    """All spans to `trace.json` (Perfetto); the last few iterations drawn to `timeline.png`."""
    spans, samples = list(run.tracer.spans), list(run.tracer.samples)
    write_chrome_trace(spans, out / "trace.json", samples)
    starts = sorted(s.start for s in spans if s.name == "iteration")
    since = starts[-last_iterations] if len(starts) >= last_iterations else 0.0
    shown = [s for s in spans if s.start >= since and s.name != "iteration"]
    marks = [(t, "iteration start") for t in starts if t >= since]
    draw_timeline(
        shown,
        out / "timeline.png",
        title=f"cadence {run.params.mode} / {run.params.placement}",
        marks=marks,
        samples=[s for s in samples if s.t >= since],
        capacity={"slots": run.params.slots},  # rows waiting: to their largest
    )
