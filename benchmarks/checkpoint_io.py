"""Checkpoint write and restore time for the default ('tiny', 3.3M-parameter) model with AdamW
state: `save_checkpoint`, and `find_checkpoint` + `restore_trainer` (which, since checkpoint
format 2, check every file's sha256 and load the state with `torch.load(weights_only=True)`).

Runs against whichever cadence is importable, so two versions can be compared side by side:

    .venv/bin/python benchmarks/checkpoint_io.py [--repeats 5]
    PYTHONPATH=/path/to/other/src .venv/bin/python benchmarks/checkpoint_io.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cadence.algo import AlgoParams
from cadence.data import ArithmeticTask
from cadence.learner import Learner, LearnerParams, Scorer
from cadence.models import init_model, load_model, load_tokenizer
from cadence.pipeline.checkpoint import (
    RunState,
    find_checkpoint,
    restore_trainer,
    rng_state,
    save_checkpoint,
)


def learner_with_state(model_dir: Path) -> Learner:
    """A learner whose AdamW holds moments for every parameter (one step on random gradients)."""
    torch.manual_seed(0)
    model = load_model(model_dir)
    learner = Learner(model, LearnerParams(), AlgoParams(), pad_id=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    learner.optimizer.step()
    learner.scheduler.step()
    return learner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model("tiny", root / "model", ArithmeticTask(seed=0).corpus(2000), seed=0)
        learner, tokenizer = learner_with_state(root / "model"), load_tokenizer(root / "model")
        scorer = Scorer(AlgoParams())
        extra = RunState(
            cursor=0,
            metrics_bytes=0,
            records=[{"iteration": i, "loss": 0.1, "reward_mean": 0.5} for i in range(100)],
            accuracy_before=0.3,
            rng=rng_state(),
            reference_path=str(root / "model"),
        )
        save_s, restore_s = [], []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            path = save_checkpoint(root / "run", i + 1, learner, scorer, tokenizer, extra, keep=2)
            save_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            restore_trainer(learner, find_checkpoint(root / "run"), None)
            restore_s.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"checkpoint size: {size / 1e6:.1f} MB")
    print(f"save:    median {statistics.median(save_s):.3f} s of {args.repeats}")
    print(f"restore: median {statistics.median(restore_s):.3f} s of {args.repeats}")


if __name__ == "__main__":
    main()
