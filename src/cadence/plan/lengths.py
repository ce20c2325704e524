"""Response-length distributions for the planner: fixed, uniform, lognormal, empirical.

A distribution draws an (iterations, prompts, group_size) array of response lengths in tokens,
each clipped to [1, max_new_tokens] (a response that would run longer stops at the cap, as a real
engine's would). Draws come from one seeded numpy generator, and the planner draws them once per
cluster size, so every mode and split is simulated on the same responses.

Empirical lengths are read from a file: per-sample lengths (a JSON list, one integer per line, or
JSONL records with `response_lengths` lists or `response_tokens` numbers), or a run's
`metrics.jsonl`, which holds one `response_tokens_mean` per iteration: the spread of those means
is far narrower than the spread of single responses, and the `note` says so.
Must not: import torch, or read anything but the file it is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("fixed", "uniform", "lognormal", "empirical")


class LengthsError(ValueError):
    """A length file is missing or holds no usable lengths; the message names the file."""


@dataclass(frozen=True)
class ResponseLengths:
    kind: str
    tokens: int = 0  # fixed
    low: int = 1  # uniform, inclusive
    high: int = 1
    mean: float = 0.0  # lognormal: mean of the (unclipped) distribution, tokens
    sigma: float = 0.0  # lognormal: standard deviation of log(length)
    values: tuple[int, ...] = ()  # empirical
    note: str = ""  # where empirical values came from, and what they miss

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...], cap: int) -> np.ndarray:
        """Lengths of the given shape, integers in [1, cap]."""
        if self.kind == "fixed":
            x = np.full(shape, self.tokens, dtype=np.int64)
        elif self.kind == "uniform":
            x = rng.integers(self.low, self.high + 1, size=shape)
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[length] = mean
            x = np.rint(rng.lognormal(mu, self.sigma, size=shape)).astype(np.int64)
        elif self.kind == "empirical":
            x = rng.choice(np.asarray(self.values, dtype=np.int64), size=shape, replace=True)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}; allowed: {KINDS}")
        return np.clip(x, 1, cap)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.tokens}"
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        if self.kind == "lognormal":
            return f"lognormal mean {self.mean:g}, sigma {self.sigma:g}"
        vals = np.asarray(self.values)
        return (
            f"empirical ({len(vals)} values, mean {vals.mean():.1f}, "
            f"p50 {np.median(vals):.0f}, max {vals.max()})"
        )


def load_empirical(path: str | Path) -> ResponseLengths:
    """Per-sample lengths, or a run's per-iteration means, from a file or a run directory."""
    p = Path(path)
    if p.is_dir() or p.name == "trace.json":  # a run: its metrics.jsonl holds the lengths
        run = p if p.is_dir() else p.parent
        p = run / "metrics.jsonl"
        if not p.is_file():
            raise LengthsError(
                f"'{path}': no metrics.jsonl in {run} (trace.json holds span times, not token "
                "counts; give the run's metrics.jsonl or a file of per-sample lengths)"
            )
    if not p.is_file():
        raise LengthsError(f"length file '{p}' does not exist")
    text = p.read_text()
    if p.suffix == ".json":
        values, note = _from_json(p, text), f"per-sample lengths from {p}"
    else:
        values, note = _from_lines(p, text)
    if not values:
        raise LengthsError(f"'{p}' holds no response lengths")
    if min(values) < 1:
        raise LengthsError(f"'{p}': response lengths must be >= 1; found {min(values)}")
    return ResponseLengths("empirical", values=tuple(values), note=note)


def _from_json(p: Path, text: str) -> list[int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LengthsError(f"'{p}' is not valid JSON: {e}") from None
    if not isinstance(data, list) or not all(isinstance(v, int | float) for v in data):
        raise LengthsError(f"'{p}': expected a JSON list of response lengths")
    return [round(v) for v in data]


def _from_lines(p: Path, text: str) -> tuple[list[int], str]:
    samples: list[int] = []
    means: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise LengthsError(f"{p}:{lineno}: not a number or a JSON object") from None
        if isinstance(item, int | float):
            samples.append(round(item))
        elif isinstance(item, dict) and isinstance(item.get("response_lengths"), list):
            samples.extend(round(v) for v in item["response_lengths"])
        elif isinstance(item, dict) and item.get("response_tokens") is not None:
            samples.append(round(item["response_tokens"]))
        elif isinstance(item, dict) and item.get("response_tokens_mean") is not None:
            means.append(round(item["response_tokens_mean"]))
    if samples:
        return samples, f"per-sample lengths from {p}"
    note = (
        f"per-iteration means from {p}: the file records no single-response lengths, so the "
        "spread (and any long tail) of single responses is narrower here than in the run"
    )
    return means, note
