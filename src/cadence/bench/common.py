"""What the side-by-side suites share: interleaved repeats, medians, the machine's description.

Cells run in rounds (every cell once, then every cell again) so that drift in the machine's speed
(another tenant, thermal limits) hits all cells alike; each figure is the median over rounds.
This module times nothing itself and imports no model library.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable, Sequence
from importlib import metadata


def interleave(
    names: Sequence[str], repeats: int, run_cell: Callable[[str, int], dict]
) -> dict[str, list[dict]]:
    """`run_cell(name, repeat)` for every name, round after round; the results per name."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names:
            result = run_cell(name, rep)
            samples[name].append(result)
            print(
                f"repeat {rep + 1}/{repeats} {name}: tpspd {result['tpspd']:,.0f}, "
                f"wall {result['wall_s']:.1f}s",
                flush=True,
            )
    return samples


def median_row(samples: list[dict], figures: Sequence[str]) -> dict:
    """The first sample's other fields, with each figure replaced by its median (None stays)."""
    row = {k: v for k, v in samples[0].items() if k not in figures}
    for f in figures:
        values = [s[f] for s in samples if s.get(f) is not None]
        row[f] = statistics.median(values) if values else None
    row["repeats"] = len(samples)
    row["tpspd_all"] = [s["tpspd"] for s in samples]
    return row


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """Where the figures were taken: enough to tell two machines (or library versions) apart."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "trl": package_version("trl"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _answer(fn: Callable, args: tuple, conn) -> None:
    """In the spawned process: `fn(*args)`'s value, or the traceback it raised, to `conn`."""
    import traceback

    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_apart(fn: Callable, *args):
    """`fn(*args)` in a process of its own (not a daemon: a run may start processes of its own),
    so that nothing one tool leaves in this process (torch's thread count and pools, the
    allocator's free lists, imported hooks) slows the next. It forks from the fork server
    (backend/procs.py), which has imported torch and transformers and run nothing: what a fresh
    interpreter holds, without its 8-9 s of imports. `fn` must be importable; its value comes
    back pickled, and what it raised as a RuntimeError with its traceback."""
    from cadence.backend.procs import fork_server

    ctx = fork_server()
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_answer, args=(fn, args, send), name=f"cadence-{fn.__name__}")
    process.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        kind, value = "error", f"{fn.__name__}'s process exited without answering"
    finally:
        process.join()
    if kind == "error":
        raise RuntimeError(f"{fn.__name__} failed in its own process:\n{value}")
    return value
