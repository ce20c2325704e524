"""nvidia-smi, read for `make gpu-check`: whether there is a GPU, what it is, and how much of
its memory the device and each process use over time. The standard library only (the check asks
before anything is installed); no CUDA context is made, so the figures are the runs' own.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpu_names() -> list[str]:
    """One 'name, memory, driver' line per GPU."""
    text = nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def smi_rows(text: str | None) -> list[list[int]]:
    """The rows of nvidia-smi's `--format=csv,noheader,nounits` output that are all integers."""
    rows = []
    for line in (text or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if cells and all(c.isdigit() for c in cells):
            rows.append([int(c) for c in cells])
    return rows


class GpuMemory:
    """Peak GPU memory (MiB) while the `with` block runs, from nvidia-smi every `period_s`: the
    device's used memory (`device_peak_mb`, with `device_idle_mb` at the start) and each
    process's (`process_peak_mb`, by pid; empty where the machine does not show processes)."""

    def __init__(self, smi: Callable[..., str | None] = nvidia_smi, period_s: float = 0.5):
        self.smi, self.period_s = smi, period_s
        self.idle: int | None = None
        self.device_peak: int | None = None
        self.by_pid: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory", daemon=True)

    def __enter__(self) -> GpuMemory:
        self.idle = self._device_used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _device_used(self) -> int | None:
        rows = smi_rows(self.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits"))
        return sum(r[0] for r in rows) if rows else None

    def _poll(self) -> None:
        while True:
            used = self._device_used()
            if used is not None:
                self.device_peak = max(used, self.device_peak or 0)
            apps = self.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
            for pid, mb in (r for r in smi_rows(apps) if len(r) == 2):
                self.by_pid[pid] = max(mb, self.by_pid.get(pid, 0))
            if self._stop.wait(self.period_s):
                return

    def figures(self) -> dict:
        return {
            "device_idle_mb": self.idle,
            "device_peak_mb": self.device_peak,
            "process_peak_mb": {str(pid): mb for pid, mb in sorted(self.by_pid.items())},
        }
