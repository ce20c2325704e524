"""What every study shares: run one configuration into its own directory, resuming a run an
interrupted study left unfinished, and read lists from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def parse_list(text: str, allowed: dict | None, kind: str) -> list[str]:
    """Comma-separated items, each in `allowed` (when given); none, or an unknown one, raises."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if allowed is not None and x not in allowed]
    if not items or unknown:
        raise ValueError(f"unknown {kind} {unknown}; allowed: {', '.join(allowed or [])}")
    return items


def parse_seeds(text: str) -> list[int]:
    """Comma-separated integer seeds (`--seeds`); none, or one that is not an integer, raises."""
    return [int(n) for n in parse_list(text, None, "seed(s)")]


def train_or_resume(config: str | None, overrides: list[str], out: Path) -> dict[str, Any]:
    """Train `config` with `overrides` into `out`, from its newest checkpoint if an earlier
    attempt stopped there; the run's summary (read back if the run had already finished, e.g.
    when a study stopped before recording its row)."""
    import json

    from cadence.builder import build_run, train
    from cadence.config import load_config
    from cadence.pipeline.checkpoint import find_checkpoint
    from cadence.pipeline.checkpoint_files import list_checkpoints

    cfg = load_config(config, overrides)
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    unfinished = list_checkpoints(out) and not (out / "summary.json").exists()
    resume = find_checkpoint(out) if unfinished else None
    return train(build_run(cfg, resume=resume), out)
