"""What `pipeline.verify_weights = "fingerprint"` costs a weight sync, side by side in one run.

The sync is the local backend's, as a run makes it: the learner publishes a version into shared
memory (`SharedWeights.publish`), tells a worker process (`LocalPool.send_sync_to`), and waits
for its acknowledgement once the worker has loaded it into its engine's model. Checked, the
learner also fingerprints what it publishes (beside the copy, in a thread: `published`) and the
worker fingerprints what it then holds before it acknowledges (models/fingerprint.py).

Two measures, for each model directory trained whole and as a LoRA adapter (r = 16 on every
projection, as configs/smollm2.toml: the merged weights are published, and the check reads the
fingerprints the merge recorded):
- end to end: syncs with and without the check alternate through a real worker process
  (medians of `--repeats`); their difference is within the machine's noise at this size;
- the parts, in one process, each timed on its own right after a sync has swept the weights
  through the caches: the worker's check of what it loaded (on the sync's path) and the
  learner's fingerprint (beside its copy: off the path where a second core is free).

    .venv/bin/python benchmarks/fingerprint_cost.py runs/base runs/smollm2 [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
sys.path.insert(0, str(ROOT / "src"))


def _nudge(model) -> None:
    """An optimizer step's worth of change: every trained tensor moves."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad or "lora_" in name:
                p.add_(1e-3)


def _policy(path: str, lora: bool):
    """(the model that trains, {checked: the view a transport publishes}): a view each, for a
    LoRA policy's merged weights record their fingerprints once asked for them."""
    from cadence.models import load_model
    from cadence.models.lora import LoraSpec, MergedWeights, apply_lora

    model = load_model(path)
    if not lora:
        return model, {False: model, True: model}
    model = apply_lora(model, LoraSpec(16, 32.0, 0.0, PROJECTIONS))
    return model, {False: MergedWeights(model), True: MergedWeights(model)}


def _synced(pool, shared, model, version: int, verify: bool) -> float:
    """Seconds of one sync of `version` to worker 0, checked or not."""
    from cadence.models.fingerprint import published

    start = time.perf_counter()
    expected = None
    if verify:  # as the gate does: fingerprinted beside the copy
        expected = published(model, lambda: shared.publish(model, version))
    else:
        shared.publish(model, version)
    pool.send_sync_to(0, version, expected)
    while True:
        event = pool.poll(60.0)
        if event is not None and event[0] == "ack" and event[2] == version:
            return time.perf_counter() - start


def _end_to_end(path: str, lora: bool, repeats: int, threads: int) -> tuple[float, float]:
    """(median seconds of a sync, of a checked one) through a worker process."""
    from cadence.backend import LocalPool, SharedWeights, WorkerSpec
    from cadence.engine import SamplingParams

    model, view = _policy(path, lora)
    spec = WorkerSpec(
        model_path=path, dtype="float32", reward="math",
        sampling=SamplingParams(max_new_tokens=4), group_size=2, run_seed=0,
        threads=threads, max_num_seqs=4,
    )  # fmt: skip
    shared = SharedWeights(view[False])
    pool = LocalPool(spec, shared, 1, timeout_s=120)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(repeats):
            for verify in (False, True):
                _nudge(model)
                times[verify].append(
                    _synced(pool, shared, view[verify], 1 + 2 * i + verify, verify)
                )
    finally:
        pool.close()
    return statistics.median(times[False]), statistics.median(times[True])


def _parts(path: str, lora: bool, repeats: int) -> tuple[float, float, float]:
    """(median seconds of publish + load in one process, of the worker's check right after,
    of the learner's fingerprint after that)."""
    from cadence.backend import SharedWeights
    from cadence.engine import load_into
    from cadence.models import load_model
    from cadence.models.fingerprint import fingerprint, held

    model, view = _policy(path, lora)
    worker = load_model(path)
    shared = SharedWeights(view[True])
    fingerprint(view[True])  # asked once: a LoRA view records from now on
    syncs, checks, learners = [], [], []
    for _ in range(repeats):
        _nudge(model)
        start = time.perf_counter()
        shared.publish(view[True], 1)
        load_into(worker, shared.tensors)
        syncs.append(time.perf_counter() - start)
        start = time.perf_counter()
        expected = fingerprint(view[True])
        learners.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = held(worker, expected)
        checks.append(time.perf_counter() - start)
        assert got == expected
    return statistics.median(syncs), statistics.median(checks), statistics.median(learners)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from cadence.models import load_model

    torch.set_num_threads(args.threads)
    print(
        "| model | parameters | sync s | checked sync s | difference | in one process: "
        "publish + load s | worker's check s | / sync | learner's fingerprint s (beside) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path, lora in [(p, lora) for p in args.models for lora in (False, True)]:
        sync, checked = _end_to_end(path, lora, args.repeats, args.threads)
        floor, check, learner = _parts(path, lora, args.repeats)
        n = sum(p.numel() for p in load_model(path).parameters())
        name = Path(path).name + (" (LoRA)" if lora else "")
        print(
            f"| {name} | {n:,} | {sync:.4f} | {checked:.4f} | {(checked - sync) / sync:+.1%} "
            f"| {floor:.4f} | {check:.4f} | {check / floor:.1%} | {learner:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
