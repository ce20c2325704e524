"""Where per-iteration metrics go: a JSONL file, TensorBoard, memory (tests), the console.

Every sink takes `write(record)` with a flat dict of numbers (plus `iteration`, and lists such
as `staleness_hist`, which sinks that only plot scalars skip) and `close()`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from cadence.metrics.files import write_all, writing


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, each written straight to the file (no buffer) so a crash loses
    nothing already written. A line is whole or absent: a write that fails (a full disk) is cut
    back off the file, and raises `OSError(ENOSPC, ..., path)` if the disk was full."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in record.items()
        }
        line = (json.dumps(clean) + "\n").encode()
        size = os.fstat(self._fd).st_size
        with writing(self.path):
            try:
                write_all(self._fd, line)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no half line for a reader, or a resume
                raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MemorySink:
    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` extra

        self._w = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["iteration"])
        for k, v in record.items():
            if k != "iteration" and isinstance(v, int | float):
                self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class ConsoleProgress:
    """Progress over iterations with the headline figures of the last one: a live rich bar on a
    terminal; elsewhere (`make run > log`, a job's captured output, where the bar's columns are
    cut to nothing) one plain line every `every` iterations (by default a twentieth of the run)
    and at the last."""

    def __init__(
        self, total: int, enabled: bool = True, done: int = 0, stream=None, every: int | None = None
    ) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.enabled, self.total, self.done = enabled, total, done
        self._stream = stream or sys.stdout
        self.live = enabled and self._stream.isatty()
        self.every = every or max(1, total // 20)
        self._start = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(file=self._stream),
            disable=not self.live,
        )
        self._task = self._progress.add_task("train", total=total, completed=done, status="")
        if self.live:
            self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        status = (
            f"reward {record.get('reward_mean', 0):.3f}  acc {record.get('accuracy', 0):.3f}  "
            f"kl {record.get('kl', 0):.4f}  tpspd {record.get('tpspd', 0):,.0f}"
        )
        if "distill_reverse_kl" in record:
            status += f"  teacher kl {record['distill_reverse_kl']:.4f}"
        if "heldout_accuracy" in record:
            status += f"  held-out {record['heldout_accuracy']:.3f}"
        self.done += 1
        self._progress.update(self._task, advance=1, status=status)
        if (
            self.enabled
            and not self.live
            and (self.done % self.every == 0 or self.done == self.total)
        ):
            elapsed = time.perf_counter() - self._start
            line = f"RL {self.done}/{self.total}  {elapsed:,.0f}s  {status}"
            print(line, file=self._stream, flush=True)

    def close(self) -> None:
        if self.live:
            self._progress.stop()
