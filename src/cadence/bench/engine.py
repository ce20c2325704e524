"""`cadence bench --suite engine`: static batching, `model.generate`, continuous batching and vLLM.

Read on: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.metrics.tables import markdown_table as table

ENGINES = ("static", "generate", "continuous")
WORKLOADS = {  # name -> (max_new_tokens, number of stop ids)
    "long-tail": (256, 12),
    "uniform": (64, 0),
}


def _requests(tokenizer, num_prompts: int, group_size: int):
    from cadence.data import ArithmeticTask, make_prompt
    from cadence.engine import Request, derive_seed

    task = ArithmeticTask(difficulty=2, seed=1)
    prompts = [tokenizer(make_prompt(e.question))["input_ids"] for e in task.heldout()]
    return [
        Request(p, [derive_seed(0, 0, i, j) for j in range(group_size)])
        for i, p in enumerate(prompts[:num_prompts])
    ]


def _stop_ids(tokenizer, count: int) -> tuple[int, ...]:
    special = set(tokenizer.all_special_ids)
    return tuple(i for i in range(100, 100 + count + len(special)) if i not in special)[:count]


def _run_batches(requests, batch_rows: int, generate_batch: Callable) -> tuple[int, float]:
    """Feed whole requests in batches of at most `batch_rows` rows: (new tokens, first group s)."""
    start, first, tokens = time.perf_counter(), None, 0
    chunk: list = []
    for req in [*requests, None]:
        rows = sum(len(r.seeds) for r in chunk)
        if chunk and (req is None or rows + len(req.seeds) > batch_rows):
            tokens += generate_batch(chunk)
            first = first if first is not None else time.perf_counter() - start
            chunk = []
        if req is not None:
            chunk.append(req)
    return tokens, first


def _static(model, tokenizer, requests, params, max_num_seqs):
    from cadence.engine import HFEngine

    engine = HFEngine(model, tokenizer, max_num_seqs=max_num_seqs)

    def batch(chunk):
        return sum(len(c.token_ids) for g in engine.generate(chunk, params) for c in g)

    return _run_batches(requests, max_num_seqs, batch)


def _generate(model, tokenizer, requests, params, max_num_seqs):
    stops = list(params.stop_token_ids)

    @torch.inference_mode()
    def batch(chunk):
        rows = [r.prompt_ids for r in chunk for _ in r.seeds]
        tokenizer.padding_side = "left"
        enc = tokenizer.pad({"input_ids": rows}, return_tensors="pt")
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=params.temperature,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0 if stops else params.max_new_tokens,
            eos_token_id=stops or None,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out[:, enc["input_ids"].shape[1] :]  # (R, T)
        if not stops:
            return new.numel()
        hit = torch.isin(new, torch.tensor(stops))  # (R, T)
        first = torch.where(hit.any(-1), hit.float().argmax(-1) + 1, new.shape[1])  # (R,)
        return int(first.sum())

    return _run_batches(requests, max_num_seqs, batch)


def _continuous(model, tokenizer, requests, params, max_num_seqs):
    from cadence.engine import ContinuousEngine

    engine = ContinuousEngine(model, tokenizer, max_num_seqs=max_num_seqs)
    start, first, tokens = time.perf_counter(), None, 0
    for i, r in enumerate(requests):
        engine.add(i, r, params)
    while engine.busy:
        for _, group in engine.step():
            tokens += sum(len(c.token_ids) for c in group)
            first = first if first is not None else time.perf_counter() - start
    return tokens, first


class _VLLM:
    """vLLM's engine in this process, started once (seconds: not timed) and streamed like the
    continuous engine: every request added at once, groups counted as they finish."""

    def __init__(self, path: str, tokenizer, max_num_seqs: int) -> None:
        from cadence.engine.vllm import VLLMEngine, VLLMOptions

        options = VLLMOptions(enforce_eager=True)  # as the tests run it: no compile step
        self.engine = VLLMEngine(path, tokenizer, max_num_seqs=max_num_seqs, options=options)

    def __call__(self, model, tokenizer, requests, params, max_num_seqs):
        start, first, tokens = time.perf_counter(), None, 0
        for i, r in enumerate(requests):
            self.engine.add(i, r, params)
        while self.engine.busy:
            for _, group in self.engine.step():
                tokens += sum(len(c.token_ids) for c in group)
                first = first if first is not None else time.perf_counter() - start
        return tokens, first


RUNNERS = {"static": _static, "generate": _generate, "continuous": _continuous}
OWN_COPY = {"vllm": _VLLM}  # engines that load their own copy of the model, started once
BASELINE = "static"  # every row's speed is given against this engine's on its workload


def default_engines() -> tuple[str, ...]:
    """Cadence's engines, and vLLM where it is installed."""
    from cadence.engine.vllm import vllm_available

    return (*ENGINES, *OWN_COPY) if vllm_available() else ENGINES


def bench_engine(
    out: Path,
    repeats: int,
    model_dir: str | None = None,
    num_prompts: int = 32,
    group_size: int = 8,
    max_num_seqs: int = 64,
    workloads: tuple[str, ...] = tuple(WORKLOADS),
    engines: tuple[str, ...] | None = None,
) -> list[dict]:
    from cadence.data import ArithmeticTask
    from cadence.models import init_model, load_model, load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    engines = engines or default_engines()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir
        if path is None:  # a random-init model: near-uniform outputs make the length tail
            path = Path(tmp) / "tiny"
            init_model("tiny", path, ArithmeticTask(difficulty=2).corpus(5000), seed=0)
        model, tokenizer = load_model(path), load_tokenizer(path)
        runners = dict(RUNNERS)
        own = set(engines) & set(OWN_COPY)  # they load the directory themselves
        for name in own:
            runners[name] = OWN_COPY[name](str(path), tokenizer, max_num_seqs)
        try:
            requests = _requests(tokenizer, num_prompts, group_size)
            rows = _measure(
                model, tokenizer, runners, engines, workloads, repeats, requests, max_num_seqs
            )
        finally:
            for name in own:
                runners[name].engine.close()
    for row in rows:
        base = next(r for r in rows if (r["workload"], r["engine"]) == (row["workload"], BASELINE))
        row["vs_static"] = round(row["new_tokens_per_s"] / base["new_tokens_per_s"], 2)
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    (out / "bench.md").write_text(markdown_table(rows))
    return rows


def _measure(
    model, tokenizer, runners, engines, workloads, repeats, requests, max_num_seqs
) -> list[dict]:
    """Rows of new tokens/s and first-group time, each engine on each workload, interleaved."""
    from cadence.engine import SamplingParams

    rows = []
    for workload in workloads:
        max_new, num_stops = WORKLOADS[workload]
        params = SamplingParams(
            max_new_tokens=max_new, stop_token_ids=_stop_ids(tokenizer, num_stops)
        )
        for name in engines:  # warm-up
            runners[name](model, tokenizer, requests[:2], params, max_num_seqs)
        times: dict[str, list[float]] = {n: [] for n in engines}
        firsts: dict[str, list[float]] = {n: [] for n in engines}
        tokens: dict[str, int] = {}
        for _ in range(repeats):  # interleaved: drift hits every engine alike
            for name in engines:
                t0 = time.perf_counter()
                tokens[name], first = runners[name](
                    model, tokenizer, requests, params, max_num_seqs
                )
                times[name].append(time.perf_counter() - t0)
                firsts[name].append(first)
        for name in engines:
            wall = statistics.median(times[name])
            rows.append(
                {
                    "workload": workload,
                    "engine": name,
                    "new_tokens": tokens[name],
                    "wall_s": round(wall, 3),
                    "new_tokens_per_s": round(tokens[name] / wall),
                    "first_group_s": round(statistics.median(firsts[name]), 3),
                    "max_num_seqs": max_num_seqs,
                    "samples": sum(len(r.seeds) for r in requests),
                }
            )
    return rows


def markdown_table(rows: list[dict]) -> str:
    header = ["workload", "engine", "new tokens", "new tokens/s", "vs static", "first group (s)"]
    cells = [
        [
            *(r["workload"], r["engine"], f"{r['new_tokens']:,}", f"{r['new_tokens_per_s']:,}"),
            *(f"{r['vs_static']:.2f}x", f"{r['first_group_s']:.2f}"),
        ]
        for r in rows
    ]
    return table(header, cells) + "\n"
