"""Weight-sync time per policy version on a local Ray, against the local backend's shared memory.

For each model (the default `tiny` preset, 3.3M parameters, and a ~100M-parameter random-init
Llama) and each way weights travel (local backend: shared memory; Ray: object store, gloo
broadcast), start `--workers` real workers, then time `--versions` barriers the way the pipeline's
learner waits for them (`WorkerSource.barrier`): publish the version, send every worker the sync,
wait until all have loaded it and acknowledged. Also times the publish alone (the learner's own
cost) and measures what one iteration's groups weigh when they come back (pickled), for the
default model with the default config's rollout settings. Writes `ray_weight_sync.json` and
`.md` in `--out`.

    .venv/bin/python benchmarks/ray_weight_sync.py [--workers 2] [--versions 10]
        [--models default,100m] [--out runs/ray-weight-sync]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cadence.backend import LocalPool, SharedWeights, WorkerSpec
from cadence.builder import sampling_params
from cadence.config import load_config
from cadence.data import ArithmeticTask
from cadence.models import init_model, load_model, load_tokenizer, save_pretrained, train_tokenizer
from cadence.pipeline.prompts import PromptStream


def llama_100m(tokenizer):
    """A random-init Llama of 99.5M parameters: hidden 768, MLP 2048, 14 layers, vocab 512
    (the `small` preset's shape with two more layers; embeddings tied, as in every preset)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=14,
        num_attention_heads=12,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def make_models(root: Path, names: list[str]) -> dict[str, Path]:
    corpus = ArithmeticTask(difficulty=1, seed=0).corpus(2000)
    paths = {}
    if "default" in names:  # what `cadence init-model --preset tiny` builds
        paths["default"] = init_model("tiny", root / "default", corpus, seed=0)
    if "100m" in names:
        tokenizer = train_tokenizer(corpus)
        paths["100m"] = save_pretrained(llama_100m(tokenizer), tokenizer, root / "100m")
    return paths


def make_pool(method: str, spec: WorkerSpec, model, workers: int):
    if method == "local-shm":
        return LocalPool(spec, SharedWeights(model), workers)
    from cadence.backend.ray.pool import RayPool

    weight_sync = "object_store" if method == "ray-object-store" else "broadcast"
    return RayPool(spec, model, workers, num_cpus_per_worker=0.5, weight_sync=weight_sync)


def barrier(pool, model, version: int) -> tuple[float, float]:
    """(publish seconds, publish-to-last-ack seconds) for one version."""
    start = time.perf_counter()
    pool.weights.publish(model, version)
    published = time.perf_counter()
    for wid in range(pool.num_workers):
        pool.send_sync_to(wid, version)
    pending = set(range(pool.num_workers))
    while pending:
        message = pool.poll(60.0)
        assert message is not None and message[0] == "ack" and message[2] == version, message
        pending.discard(message[1])
    return published - start, time.perf_counter() - start


def groups_bytes(pool, model_dir: Path) -> dict:
    """Pickled size of one default-config iteration's results (what flows back per iteration)."""
    cfg = load_config("configs/default.toml", [f"model.path='{model_dir}'"])
    task = ArithmeticTask(difficulty=1, seed=0, max_operand=cfg.data.max_operand)
    stream = PromptStream(task, cfg.data.prompt_template, "arithmetic")
    prompts = stream.next_batch(cfg.train.prompts_per_iteration)
    pool.submit(0, 0, prompts, 0)
    size, samples, tokens = 0, 0, 0
    while True:
        message = pool.poll(120.0)
        assert message is not None and message[0] == "groups", message
        size += len(pickle.dumps(message[2]))
        samples += sum(len(g.completions) for g in message[2].groups)
        tokens += sum(len(c.token_ids) for g in message[2].groups for c in g.completions)
        if message[2].task_done:
            break
    return {"bytes": size, "samples": samples, "response_tokens": tokens}


def measure(method: str, name: str, model_dir: Path, workers: int, versions: int) -> dict:
    cfg = load_config("configs/default.toml", [f"model.path='{model_dir}'"])
    model = load_model(model_dir)
    spec = WorkerSpec(
        model_path=str(model_dir),
        dtype="float32",
        reward="math",
        sampling=sampling_params(cfg, load_tokenizer(model_dir)),
        group_size=cfg.rollout.group_size,
        run_seed=0,
        threads=1,
        max_num_seqs=cfg.rollout.max_num_seqs,
    )
    pool = make_pool(method, spec, model, workers)
    try:
        times = []
        for version in range(versions + 1):  # version 0 warms up; not counted
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            times.append(barrier(pool, model, version))
        times = times[1:]
        row = {
            "model": name,
            "method": method,
            "workers": workers,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes_per_version": sum(p.numel() * p.element_size() for p in model.parameters()),
            "publish_ms": 1e3 * statistics.median(t[0] for t in times),
            "sync_ms": 1e3 * statistics.median(t[1] for t in times),
            "sync_ms_max": 1e3 * max(t[1] for t in times),
            "sync_ms_each": [round(1e3 * t[1], 1) for t in times],
        }
        if name == "default" and method == "ray-object-store":
            row["groups"] = groups_bytes(pool, model_dir)
        return row
    finally:
        pool.close()


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Weight sync per version, {meta['workers']} workers, median of {meta['versions']} "
        f"versions ({meta['date']}, {meta['machine']})",
        "",
        "| model | parameters | MB per version | method | publish (ms) | sync, all acked (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['bytes_per_version'] / 1e6:.1f} "
            f"| {r['method']} | {r['publish_ms']:.1f} | {r['sync_ms']:.1f} "
            f"(max {r['sync_ms_max']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--models", default="default,100m")
    ap.add_argument("--methods", default="local-shm,ray-object-store,ray-broadcast")
    ap.add_argument("--out", default="runs/ray-weight-sync")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from cadence.backend.ray.pool import start_ray

    start_ray(None, num_cpus=2)  # one local Ray for every Ray measurement
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 learner thread",
        "workers": args.workers,
        "versions": args.versions,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_models(Path(tmp), args.models.split(","))
        for name, model_dir in paths.items():
            for method in args.methods.split(","):
                rows.append(measure(method, name, model_dir, args.workers, args.versions))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_weight_sync.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "ray_weight_sync.md").write_text(to_markdown(rows, meta))
    print(to_markdown(rows, meta))


if __name__ == "__main__":
    main()
