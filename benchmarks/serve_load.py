"""Load test of `cadence serve`: many clients at once on loopback, valid and invalid requests mixed.

Starts `cadence serve MODEL_DIR` on a free loopback port with a token (the embedded 'tiny' model,
built in a temporary directory, unless --model-dir is given), warms it up, then keeps
--concurrency requests in flight for --duration seconds, each drawn at random: a quarter
(--invalid-fraction) from the invalid cases below (a token id the model does not have, a prompt
over its context, n, max_tokens, temperature or top_p out of range, a body over the limit, not
JSON, a wrong or non-ASCII token, ...), the rest valid (messages or token ids, n up to 4,
sampled or greedy). It checks that every valid request was answered (200, n choices, token ids
and log-probs for each), every invalid one got a 4xx, /health says ok afterwards, and it samples
the server's resident memory (RSS, from /proc: Linux) during the load.

Prints and writes (--out) JSON: requests/s, latency percentiles of the valid requests, counts by
status and by case, RSS at start (after the warm-up) and end, and every problem found; exits 1
if there is one.

    .venv/bin/python benchmarks/serve_load.py [--concurrency 200] [--duration 60] [--out FILE]

`run_load` is what tests/serve/test_load.py runs for a few seconds against an in-process server.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPT = "Question: What is 12 + 30?\nAnswer: "


@dataclass(frozen=True)
class Case:
    """One kind of request: its body (a dict, or raw bytes sent as JSON) and what must come back."""

    name: str
    valid: bool
    body: dict[str, Any] | bytes
    headers: dict[str, Any] = field(default_factory=dict)


def _chat(**fields) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, **fields}


def cases(prompt_ids: list[int], max_positions: int) -> tuple[list[Case], list[Case]]:
    """(valid, invalid) requests for a server whose model has `max_positions` positions."""
    valid = [
        Case("messages", True, _chat()),
        Case("token_ids", True, _chat(prompt_token_ids=prompt_ids)),
        Case("n_4", True, _chat(n=4, max_tokens=8)),
        Case("greedy", True, _chat(temperature=0)),
    ]
    too_big = json.dumps(_chat(messages=[{"role": "user", "content": "1 " * (3 << 20)}]))
    invalid = [
        Case("token_id_out_of_range", False, _chat(prompt_token_ids=[*prompt_ids, 1_000_000])),
        Case("negative_token_id", False, _chat(prompt_token_ids=[-1])),
        Case("prompt_over_context", False, _chat(prompt_token_ids=[prompt_ids[0]] * max_positions)),
        Case("n_0", False, _chat(n=0)),
        Case("n_65", False, _chat(n=65)),
        Case("max_tokens_0", False, _chat(max_tokens=0)),
        Case("temperature_negative", False, _chat(temperature=-1)),
        Case(
            "temperature_nan", False, json.dumps(_chat())[:-1].encode() + b', "temperature": NaN}'
        ),
        Case("top_p_0", False, _chat(top_p=0)),
        Case("top_p_2", False, _chat(top_p=2)),
        Case("empty_messages", False, _chat(messages=[])),
        Case("response_format", False, _chat(response_format={"type": "json_object"})),
        Case("not_json", False, b'{"messages": [}'),
        Case("body_over_limit", False, too_big.encode()),
        Case("wrong_token", False, _chat(), {"Authorization": "Bearer wrong"}),
        Case("non_ascii_token", False, _chat(), {"Authorization": "Bearer sésame".encode()}),
    ]
    return valid, invalid


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    by_case: dict[str, Counter] = field(default_factory=dict)
    latencies_s: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    problems: list[str] = field(default_factory=list)  # the first 20
    num_problems: int = 0

    def add(self, case: Case, status: int | str, seconds: float, problem: str | None) -> None:
        self.statuses[str(status)] += 1
        self.by_case.setdefault(case.name, Counter())[str(status)] += 1
        if problem is None:
            self.latencies_s[case.valid].append(seconds)
            return
        self.num_problems += 1
        if len(self.problems) < 20:
            self.problems.append(f"{case.name}: {problem}")


def _problem(case: Case, reply: httpx.Response) -> str | None:
    """What is wrong with this reply to this case (None: it is right)."""
    if not case.valid:
        return None if 400 <= reply.status_code < 500 else f"status {reply.status_code}, not 4xx"
    if reply.status_code != 200:
        return f"status {reply.status_code}: {reply.text[:200]}"
    body, n = reply.json(), case.body.get("n", 1)
    if len(body["choices"]) != n or not body["prompt_token_ids"]:
        return f"{len(body['choices'])} choices for n = {n}"
    for choice in body["choices"]:
        if not choice["token_ids"] or len(choice["logprobs"]["content"]) != len(
            choice["token_ids"]
        ):
            return "a choice without token ids, or with a log-prob missing"
    return None


async def _send(client: httpx.AsyncClient, case: Case, rng: random.Random, tally: Tally) -> None:
    headers = {"content-type": "application/json", **case.headers}
    if isinstance(case.body, bytes):
        content = case.body
    else:
        content = json.dumps({**case.body, "seed": rng.randrange(1 << 40)}).encode()
    start = time.perf_counter()
    try:
        reply = await client.post("/v1/chat/completions", content=content, headers=headers)
    except httpx.HTTPError as e:
        tally.add(case, type(e).__name__, time.perf_counter() - start, f"no answer: {e!r}")
        return
    tally.add(case, reply.status_code, time.perf_counter() - start, _problem(case, reply))


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # unused on http://, and 90 ms to build: built once


def _client(url: str, token: str) -> httpx.AsyncClient:
    # one connection per client: httpx's pool scans all its connections for every request, which
    # at 200 connections cost the load generator more CPU than it spent on anything else
    auth = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=1)
    return httpx.AsyncClient(base_url=url, headers=auth, limits=limits, timeout=300, verify=_tls())


async def run_load(
    url: str,
    token: str,
    concurrency: int,
    duration_s: float,
    invalid_fraction: float = 0.25,
    seed: int = 0,
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight for `duration_s` against the server at `url` (its
    root, without /v1), each client on a connection of its own; then wait for those in flight
    and check /health."""
    async with _client(url, token) as client:
        info = (await client.post("/tokenize", json={"prompt": PROMPT})).json()
    valid, invalid = cases(info["tokens"], info["max_model_len"])
    tally, deadline = Tally(), time.monotonic() + duration_s

    async def worker(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        async with _client(url, token) as client:
            while time.monotonic() < deadline:
                pool = invalid if rng.random() < invalid_fraction else valid
                await _send(client, rng.choice(pool), rng, tally)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    async with _client(url, token) as client:
        health = await client.get("/health")
    return _report(tally, elapsed, health, {c.name for c in valid})


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def _report(tally: Tally, elapsed: float, health: httpx.Response, valid: set[str]) -> dict:
    total = sum(tally.statuses.values())
    num_valid = sum(sum(c.values()) for name, c in tally.by_case.items() if name in valid)
    problems = list(tally.problems)
    if health.status_code != 200:
        problems.append(f"/health after the load: {health.status_code} {health.text[:200]}")
    return {
        "seconds": round(elapsed, 2),
        "requests": total,
        "requests_per_s": round(total / elapsed, 1),
        "valid": num_valid,
        "valid_answered": len(tally.latencies_s[True]),
        "invalid": total - num_valid,
        "invalid_4xx": len(tally.latencies_s[False]),
        "latency_s": {"valid": _spread(tally.latencies_s[True])}
        | {"invalid": _spread(tally.latencies_s[False])},
        "statuses": dict(sorted(tally.statuses.items())),
        "by_case": {name: dict(c) for name, c in sorted(tally.by_case.items())},
        "health_after": health.status_code,
        "num_problems": tally.num_problems + (health.status_code != 200),
        "problems": problems,
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": _round(_percentile(values, q)) for q in (50, 90, 99)} | {
        "max": _round(max(values, default=None))
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# --- the server process -----------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, token: str, args) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "cadence.cli", "serve", str(model_dir), "--port", str(port),
        "--token", token, "--max-num-seqs", str(args.max_num_seqs),
        "--threads", str(args.threads),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"cadence serve exited: {server.stderr.read().decode()[-2000:]}")
        try:
            headers = {"Authorization": f"Bearer {token}"}
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=headers).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.kill()
    raise RuntimeError("cadence serve did not answer /health within 300 s")


def tiny_model(out: Path) -> Path:
    from cadence.data import ArithmeticTask
    from cadence.models import init_model

    init_model("tiny", out, ArithmeticTask(difficulty=1, seed=0).corpus(2000), seed=0)
    return out


async def _sample_rss(pid: int, every_s: float, into: list[float]) -> None:
    while True:
        into.append(round(rss_mib(pid), 1))
        await asyncio.sleep(every_s)


async def measure(url: str, token: str, pid: int, args) -> dict[str, Any]:
    await run_load(url, token, args.concurrency, args.warmup, args.invalid_fraction, seed=1)
    start_rss, samples = rss_mib(pid), []
    sampler = asyncio.create_task(_sample_rss(pid, args.duration / 12, samples))
    report = await run_load(url, token, args.concurrency, args.duration, args.invalid_fraction)
    sampler.cancel()
    end_rss = rss_mib(pid)
    return report | {
        "rss_mib": {"start": round(start_rss, 1), "end": round(end_rss, 1), "during": samples},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="served model (default: a fresh 'tiny' one)")
    p.add_argument("--concurrency", type=int, default=200, help="requests in flight at once")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    p.add_argument("--invalid-fraction", type=float, default=0.25)
    p.add_argument("--max-num-seqs", type=int, default=64, help="cadence serve --max-num-seqs")
    p.add_argument("--threads", type=int, default=0, help="cadence serve --threads")
    p.add_argument("--out", type=Path, default=Path("serve_load.json"))
    args = p.parse_args()
    token, port = "load-test", _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or tiny_model(Path(tmp) / "tiny")
        server = start_server(model_dir, port, token, args)
        try:
            report = asyncio.run(measure(f"http://127.0.0.1:{port}", token, server.pid, args))
        finally:
            server.terminate()
            server.wait(timeout=30)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
    } | report
    text = json.dumps(report, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 1 if report["num_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
