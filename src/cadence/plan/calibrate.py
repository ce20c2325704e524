"""`cadence plan --calibrate`: this machine's throughput, measured with the real engine and learner.

Read on: docs/planner.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cadence.algo import needs_reference
from cadence.config import Config, ConfigError
from cadence.plan.costs import Profile, Throughput

DEFAULT_MODES = ["sync-colocated", "sync", "periodic", "offpolicy-1"]


@dataclass
class Calibration:
    profile: Profile
    lengths: list[int]  # responses the model sampled for the task's prompts
    prompt_tokens: float  # their mean prompt length


@dataclass(frozen=True)
class _Decode:
    step_s: float
    per_seq_s: float
    prefill_per_token_s: float
    per_ctx_token_s: float = 0.0  # per step per token held in the cache (attention reads)


@dataclass(frozen=True)
class _Train:
    per_token_s: float
    microbatch_s: float
    optimizer_s: float


def cpu_layout(cfg: Config) -> tuple[int, int, int]:
    """(cores the separate run uses, learner threads, colocated threads) for this machine."""
    from cadence.builder import all_threads, usable_cores

    p, cores = cfg.pipeline, usable_cores()
    workers = p.num_workers * p.threads_per_worker
    learner = p.learner_threads or min(all_threads(), max(1, cores - workers))
    return workers + learner, learner, cfg.train.threads or all_threads()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def calibrate(
    model_dir: str, cfg: Config, quick: bool = False, log: Callable[[str], None] | None = None
) -> Calibration:
    """Measure the profile; `quick` uses very few tokens (tests), not for planning."""
    from cadence.engine import keeps_own_copy
    from cadence.models import load_model, load_tokenizer

    if keeps_own_copy(cfg.rollout.engine):  # the engines here decode with the model loaded below
        raise ConfigError(
            f"cadence plan --calibrate times cadence's own engines in this process, not "
            f"rollout.engine = '{cfg.rollout.engine}' (it loads its own copy of the model); it "
            "batches continuously too: calibrate with --set rollout.engine='\"continuous\"'"
        )
    say = log or (lambda _msg: None)
    devices, learner_threads, colocated_threads = cpu_layout(cfg)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    say("sampling the task's prompts to get response lengths ...")
    with _threads(colocated_threads):
        groups, score_s = _sample_groups(cfg, model_dir, model, tokenizer, quick)
    prompt_ids = [g.prompt_ids for g in groups]
    decode: dict[int, _Decode] = {}
    for threads in sorted({cfg.pipeline.threads_per_worker, colocated_threads}):
        say(f"timing decoding at {threads} thread(s) ...")
        with _threads(threads):
            decode[threads] = _measure_decode(cfg, model, tokenizer, prompt_ids, quick)
    train: dict[int, _Train] = {}
    for threads in sorted({learner_threads, colocated_threads}):
        say(f"timing training at {threads} thread(s) ...")
        with _threads(threads):
            train[threads] = _measure_train(cfg, model_dir, tokenizer.pad_token_id, groups, quick)
    publish_s, load_s = _measure_sync(model)
    worker = _throughput(
        decode[cfg.pipeline.threads_per_worker], train[learner_threads], learner_threads, score_s
    )
    profile = Profile(
        name=f"this machine ({os.cpu_count()} cores)",
        separate=replace(worker, publish_s=publish_s, load_s=load_s),
        # colocated, the engine shares the learner's model: nothing to sync
        colocated=_throughput(
            decode[colocated_threads], train[colocated_threads], devices, score_s
        ),
        source=f"calibrated on {model_dir} with the real engine and learner",
        tpspd_devices=1,
        extra={
            "decode": {str(k): v.__dict__ for k, v in decode.items()},
            "train": {str(k): v.__dict__ for k, v in train.items()},
            "threads": {"learner": learner_threads, "colocated": colocated_threads},
        },
    )
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    return Calibration(profile, lengths, float(np.mean([len(ids) for ids in prompt_ids])))


def _throughput(decode: _Decode, train: _Train, train_devices: int, score_s: float) -> Throughput:
    """Measured rates as per-device costs: the simulation divides training by its devices."""
    return Throughput(
        decode_step_s=decode.step_s,
        decode_per_seq_s=decode.per_seq_s,
        decode_per_ctx_token_s=decode.per_ctx_token_s,
        prefill_per_token_s=decode.prefill_per_token_s,
        train_per_token_s=train.per_token_s * train_devices,
        train_microbatch_s=train.microbatch_s,
        optimizer_update_s=train.optimizer_s * train_devices,
        score_per_sample_s=score_s,
    )


def _sample_groups(cfg: Config, model_dir: str, model, tokenizer, quick: bool):
    """The task's prompts sampled as `cadence train` samples them; seconds to score one."""
    from cadence.builder import make_task, open_rollout_engine, prompt_render, rollout_worker
    from cadence.pipeline.prompts import PromptStream
    from cadence.rewards import load_reward, safe_reward

    n = max(2, cfg.train.micro_batch_groups) if quick else max(32, cfg.train.micro_batch_groups)
    prompts = PromptStream(make_task(cfg), prompt_render(cfg, tokenizer), cfg.data.task).next_batch(
        n
    )
    engine, _ = open_rollout_engine(cfg, tokenizer, model=model)
    worker = rollout_worker(cfg, engine, tokenizer, model_path=model_dir, score=False)
    groups = worker.rollout(prompts, 0, 0)
    reward = load_reward(cfg.reward.function, cfg.reward.answer_format)
    start = time.perf_counter()
    for g in groups:
        for c in g.completions:
            p = g.prompt
            c.reward = safe_reward(reward, p.text, c.text, p.answer, p.metadata).value
    score_s = (time.perf_counter() - start) / sum(len(g.completions) for g in groups)
    return groups, score_s


def _measure_decode(cfg: Config, model, tokenizer, prompt_ids, quick: bool) -> _Decode:
    from cadence.builder import open_rollout_engine
    from cadence.engine import Request, SamplingParams

    G, cap = cfg.rollout.group_size, cfg.rollout.max_num_seqs
    engine, _ = open_rollout_engine(cfg, tokenizer, model=model)
    steps = 4 if quick else 24
    rows = sorted({min(G * q, cap) for q in ((1, 2) if quick else (1, 4, 16))})

    def timed(num_rows: int, new_tokens: int) -> float:
        num_prompts = -(-num_rows // G)
        reqs = [
            Request(prompt_ids[q % len(prompt_ids)], list(range(q * G, q * G + G)))
            for q in range(num_prompts)
        ]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)  # no stop: all run
        best = float("inf")
        for _ in range(1 if quick else 2):
            start = time.perf_counter()
            engine.generate(reqs, params)
            best = min(best, time.perf_counter() - start)
        return best

    timed(rows[0], 2)  # warm-up
    per_step, prefill = [], []
    for b in rows:
        first, full = timed(b, 1), timed(b, steps)
        per_step.append(max(full - first, 1e-9) / (steps - 1))
        num_prompts = -(-b // G)
        mean_prompt = np.mean([len(prompt_ids[q % len(prompt_ids)]) for q in range(num_prompts)])
        prefill.append(first / (num_prompts * mean_prompt))
    if len(rows) > 1:
        slope, intercept = np.polyfit(rows, per_step, 1)
    else:
        slope, intercept = per_step[0] / rows[0], 0.0
    if intercept < 0:  # a line through the origin is the best non-negative fit then
        slope, intercept = float(np.dot(rows, per_step) / np.dot(rows, rows)), 0.0
    per_ctx = 0.0 if quick else _per_context_token(timed, rows[-1], steps, per_step[-1], cfg)
    return _Decode(
        float(intercept), float(max(slope, 0.0)), float(statistics.median(prefill)), per_ctx
    )


def _per_context_token(timed, rows: int, steps: int, per_step: float, cfg: Config) -> float:
    """The cost of attention reads: `rows` sequences decoded to the workload's longer lengths
    (up to 4 x `steps` more tokens, within `rollout.max_new_tokens`) take longer a step than over
    the first `steps`, by this much per token held in the cache. Long-tailed responses of a few
    hundred tokens spend much of their decoding there (0 when the cap allows no longer run)."""
    longer = min(cfg.rollout.max_new_tokens, 4 * steps)
    if longer <= 2 * steps:
        return 0.0
    long_step = max(timed(rows, longer) - timed(rows, 1), 1e-9) / (longer - 1)
    extra_context = rows * (longer - steps) / 2  # mean tokens held a step, longer run minus short
    return float(max(long_step - per_step, 0.0) / extra_context)


def _computed_tokens(groups, shared: bool) -> int:
    return sum(
        (1 if shared else g.group_size) * len(g.prompt_ids)
        + sum(len(c.token_ids) for c in g.completions)
        for g in groups
    )


def _measure_train(cfg: Config, model_dir: str, pad_id: int, groups, quick: bool) -> _Train:
    from cadence.builder import build_learner, build_scorer, learner_params
    from cadence.metrics import Tracer
    from cadence.models import DTYPES, load_model

    big = min(cfg.train.micro_batch_groups, len(groups))
    small = max(1, big // 4)
    params = replace(learner_params(cfg), micro_batch_groups=big, mini_batches=1)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})
    model = load_model(model_dir, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device)
    tracer = Tracer()
    # as `cadence train` builds it: a reference exactly when the algorithm needs one
    learner = build_learner(cfg, model, pad_id, tracer, params)
    scorer = build_scorer(cfg)

    def train(n: int) -> None:
        learner.train_iteration(scorer.score(groups[:n]), n)
        scorer.end_iteration()

    train(small)  # warm-up
    times: dict[int, list[float]] = {small: [], big: []}
    steps: list[float] = []
    for _ in range(1 if quick else 3):
        for size in sorted(times):
            tracer.spans.clear()
            train(size)
            times[size].append(
                sum(s.duration for s in tracer.spans if s.name == "forward_backward")
            )
            steps += [s.duration for s in tracer.spans if s.name == "optimizer_step"]
    t_small, t_big = min(times[small]), min(times[big])
    shared = learner.layout != "unpacked"
    tok_small = _computed_tokens(groups[:small], shared)
    tok_big = _computed_tokens(groups[:big], shared)
    if tok_big > tok_small and t_big > t_small:
        per_token = (t_big - t_small) / (tok_big - tok_small)
        fixed = max(t_small - per_token * tok_small, 0.0)
    else:
        per_token, fixed = t_big / tok_big, 0.0
    if not quick and len(groups) > big:
        per_token = _per_token_over_all(learner, scorer, tracer, groups, fixed, big, shared) or (
            per_token
        )
    return _Train(per_token, fixed, statistics.median(steps))


def _per_token_over_all(learner, scorer, tracer, groups, fixed: float, big: int, shared: bool):
    """Seconds per computed token over every sampled group, in micro-batches of `big`: with
    long-tailed lengths the cost of a token depends on its row's length (attention), so the
    first few groups can be far from the mean (they made the rate 40% high on a long tail).
    0.0 where the fixed cost hides the tokens' (a tiny model): the caller keeps its own rate."""
    tracer.spans.clear()
    learner.train_iteration(scorer.score(groups), len(groups))
    scorer.end_iteration()
    total = sum(s.duration for s in tracer.spans if s.name == "forward_backward")
    batches = -(-len(groups) // big)
    return max(total - fixed * batches, 0.0) / _computed_tokens(groups, shared)


def _measure_sync(model) -> tuple[float, float]:
    """Seconds to publish into shared memory, and to load from it (median of 3 each)."""
    from cadence.backend import SharedWeights
    from cadence.engine import load_into

    shared, other = SharedWeights(model), copy.deepcopy(model)
    publish, load = [], []
    for v in range(3):
        start = time.perf_counter()
        shared.publish(model, v)
        publish.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_into(other, shared.tensors)
        load.append(time.perf_counter() - start)
    return statistics.median(publish), statistics.median(load)


def spec_from_config(cfg: Config, cal: Calibration, profile_path: str, lengths_path: str) -> dict:
    """The plan spec (as a dict, before any file or override) for this machine and config."""
    from cadence.builder.params import tasks_in_flight

    devices, _, _ = cpu_layout(cfg)
    p = cfg.pipeline
    return {
        "workload": {
            "prompts_per_iteration": cfg.train.prompts_per_iteration,
            "group_size": cfg.rollout.group_size,
            "prompt_tokens": max(1, round(cal.prompt_tokens)),
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "micro_batch_groups": cfg.train.micro_batch_groups,
            "shared_prompt": cfg.learner.shared_prompt,
            "reference_model": needs_reference(cfg.algo.loss, cfg.algo.kl_coef),
            "response": {"kind": "empirical", "path": lengths_path},
        },
        "hardware": {"profile": profile_path, "name": cal.profile.name},
        "cluster": {
            "devices": [devices],
            "engine_devices": p.threads_per_worker,
            "colocated_engine_devices": devices,
            "max_num_seqs": cfg.rollout.max_num_seqs,
            "batching": cfg.rollout.engine,  # the engine `cadence train` runs here
            # a worker never holds more than its queued tasks, whatever its slots
            "samples_in_flight": tasks_in_flight(cfg) * p.prompts_per_task * cfg.rollout.group_size,
            "prompts_per_task": p.prompts_per_task,
        },
        "plan": {"modes": list(DEFAULT_MODES)},
    }


def calibrate_to(
    cfg: Config,
    model_dir: str,
    out: Path,
    quick: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Calibrate, write `profile.json` and `lengths.json` in `out`; return the base plan spec."""
    from cadence.models.io import check_model_dir

    check_model_dir(model_dir)
    cal = calibrate(model_dir, cfg, quick=quick, log=log)
    out.mkdir(parents=True, exist_ok=True)
    profile_path, lengths_path = out / "profile.json", out / "lengths.json"
    profile_path.write_text(json.dumps(cal.profile.to_dict(), indent=2) + "\n")
    lengths_path.write_text(json.dumps(cal.lengths) + "\n")
    return spec_from_config(cfg, cal, str(profile_path), str(lengths_path))
