"""Where per-iteration metrics go: a JSONL file, TensorBoard, memory (tests), the console.

Every sink takes `write(record)` with a flat dict of numbers (plus `iteration`, and lists such
as `staleness_hist`, which sinks that only plot scalars skip) and `close()`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed per record so a crash loses nothing already written."""

    def __init__(self, path: str | Path) -> None:
        self._f = Path(path).open("a", encoding="utf-8")  # noqa: SIM115 (held until close)

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in record.items()
        }
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


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
    """A live rich progress bar over iterations with the headline figures of the last one."""

    def __init__(self, total: int, enabled: bool = True, done: int = 0) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total, completed=done, status="")
        if enabled:
            self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        status = (
            f"reward {record.get('reward_mean', 0):.3f}  acc {record.get('accuracy', 0):.3f}  "
            f"kl {record.get('kl', 0):.4f}  tpspd {record.get('tpspd', 0):,.0f}"
        )
        if "heldout_accuracy" in record:
            status += f"  held-out {record['heldout_accuracy']:.3f}"
        self._progress.update(self._task, advance=1, status=status)

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()
