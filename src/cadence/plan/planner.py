"""The planner: every mode on every split worth trying, for each cluster size; the best split.

For each cluster size D, `sync-colocated` is one simulation (all D devices generate, then all
train); each separate mode is simulated with i devices generating and D - i training, for the
splits in `plan.splits` or those a search picks: every split when there are few, otherwise ten
spread evenly and then a hill climb with halving steps around the best. Every simulation of a
cluster size sees the same response lengths (one seeded draw), so differences between modes and
splits come from the pipeline, not from sampling noise. The recommendation is the (mode, split)
with the highest TPSPD among all simulated (a tie within 0.1% goes to the less stale mode).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cadence.choices import engine_kind
from cadence.config import ConfigError
from cadence.plan.costs import DeviceSpec, ModelShape, Profile, from_hardware
from cadence.plan.lengths import LengthsError, ResponseLengths, load_empirical
from cadence.plan.sim import Shape, SimResult, Workload, simulate
from cadence.plan.spec import PlanSpec, parse_mode

# what cadence runs colocated today, against what the simulation's sync-colocated assumes
COLOCATED_NOTE = (
    "sync-colocated on more than one device assumes an engine on every device beside a learner "
    "rank, as colocated systems (verl) run; cadence colocates one engine with one learner "
    "process (learner.ranks > 1 colocated on GPUs is refused), so on D devices it is the "
    "yardstick, not a cadence setting: cadence's own runs are the separate modes"
)
EXHAUSTIVE_SPLITS = 12  # simulate every split up to this many candidates
TIE = 1e-3  # TPSPDs closer than this (relative) are a tie: below the simulation's resolution


@dataclass
class ClusterPlan:
    devices: int
    results: list[SimResult]  # every (mode, split) simulated
    best: dict[str, SimResult]  # per mode label, its highest-TPSPD split
    recommended: SimResult
    min_training_devices: int | None = None  # fewest that hold the learner (None: none do)

    def to_dict(self) -> dict:
        return {
            "devices": self.devices,
            "min_training_devices": self.min_training_devices,
            "recommended": self.recommended.to_dict(),
            "best": {k: v.to_dict() for k, v in self.best.items()},
            "results": [r.to_dict() for r in self.results],
        }


@dataclass
class PlanResult:
    spec: PlanSpec
    profile: Profile
    lengths: ResponseLengths
    clusters: list[ClusterPlan]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "spec": self.spec.model_dump(),
            "profile": self.profile.to_dict(),
            "response_lengths": {
                "distribution": self.lengths.describe(),
                "note": self.lengths.note,
            },
            "clusters": [c.to_dict() for c in self.clusters],
            "notes": self.notes,
        }


def response_lengths(spec: PlanSpec) -> ResponseLengths:
    r = spec.workload.response
    if r.kind == "empirical":
        try:
            return load_empirical(r.path or "")
        except LengthsError as e:
            raise ConfigError(f"plan key 'workload.response.path': {e}") from None
    return ResponseLengths(
        r.kind, tokens=r.tokens, low=r.low, high=r.high, mean=r.mean, sigma=r.sigma
    )


def load_profile(spec: PlanSpec, mean_response: float) -> Profile:
    """The throughput profile: from `hardware.profile`, or from the peak rates."""
    hw, w = spec.hardware, spec.workload
    if hw.profile:
        try:
            return Profile.from_dict(json.loads(Path(hw.profile).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"plan key 'hardware.profile': cannot use '{hw.profile}': {e}"
            ) from None
    m = spec.model
    device = DeviceSpec(
        name=hw.name,
        flops=hw.flops,
        mem_bw=hw.mem_bw,
        memory_bytes=hw.memory_gb * 1e9,
        mem_efficiency=hw.mem_efficiency,
        decode_efficiency=hw.decode_efficiency,
        prefill_efficiency=hw.prefill_efficiency,
        train_mfu=hw.train_mfu,
        network_bw=hw.network_bw,
        sync_bw=hw.sync_bw,
        sync_latency_s=hw.sync_latency_s,
        host_copy_bw=hw.host_copy_bw,
        step_overhead_s=hw.step_overhead_s,
        kv_memory_fraction=hw.kv_memory_fraction,
        train_memory_fraction=hw.train_memory_fraction,
    )
    shape = ModelShape(
        m.params, m.layers, m.hidden, m.kv_dim, m.bytes_per_param, m.intermediate, m.vocab
    )
    return from_hardware(
        shape,
        device,
        seq_tokens=w.prompt_tokens + mean_response,
        reference_model=w.reference_model,
        engine_devices=spec.cluster.engine_devices,
        micro_batch_tokens=micro_batch_tokens(w),
        checkpointing=w.activation_checkpointing,
        logits_chunk=w.logits_chunk_tokens,
        weight_sync=spec.cluster.weight_sync,
    )


def micro_batch_tokens(w) -> int:
    """The tokens of the longest micro-batch: the budget (a part of one response over it goes
    alone: a prompt and a response of the cap), or whole groups of responses of the cap (each
    prompt once when the learner shares it)."""
    if w.micro_batch_tokens:
        return max(w.micro_batch_tokens, w.prompt_tokens + w.max_new_tokens)
    prompts = 1 if w.shared_prompt else w.group_size
    return w.micro_batch_groups * (prompts * w.prompt_tokens + w.group_size * w.max_new_tokens)


def workload(spec: PlanSpec) -> Workload:
    w, c = spec.workload, spec.cluster
    return Workload(
        prompts_per_iteration=w.prompts_per_iteration,
        group_size=w.group_size,
        prompt_tokens=w.prompt_tokens,
        micro_batch_groups=w.micro_batch_groups,
        max_num_seqs=c.max_num_seqs,
        samples_in_flight=c.samples_in_flight,
        shared_prompt=w.shared_prompt,
        batching=c.batching,
        prompts_per_task=c.prompts_per_task,
        engine_devices=c.engine_devices,
        colocated_engine_devices=c.colocated_engine_devices,
        learner_strategy=c.learner_strategy,
        layout=w.layout,
    )


def plan(spec: PlanSpec, log: Callable[[str], None] | None = None) -> PlanResult:
    dist = response_lengths(spec)
    w = spec.workload
    rng = np.random.default_rng(spec.plan.seed)
    shape = (
        spec.plan.iterations + 2 * _max_staleness(spec) + 1,
        w.prompts_per_iteration,
        w.group_size,
    )
    lengths = dist.sample(rng, shape, w.max_new_tokens)
    profile = load_profile(spec, float(lengths.mean()))
    work = workload(spec)
    notes = [dist.note] if dist.note else []
    if "sync-colocated" in spec.plan.modes and max(spec.cluster.devices) > 1:
        notes.append(COLOCATED_NOTE)
    clusters = []
    for devices in spec.cluster.devices:
        if log:
            log(f"planning {devices} devices ...")
        clusters.append(plan_cluster(spec, devices, work, profile, lengths, notes))
    return PlanResult(spec, profile, dist, clusters, notes)


def _max_staleness(spec: PlanSpec) -> int:
    return max(parse_mode(m)[2] for m in spec.plan.modes)


def _lengths_for(lengths: np.ndarray, staleness: int, measured: int, most: int) -> np.ndarray:
    """The slice a mode simulates: its measured iterations are the same draws for every mode."""
    start = most - staleness
    return lengths[start : start + measured + 2 * staleness + 1]


def plan_cluster(
    spec: PlanSpec,
    devices: int,
    work: Workload,
    profile: Profile,
    lengths: np.ndarray,
    notes: list[str],
) -> ClusterPlan:
    results: list[SimResult] = []
    strategy = work.learner_strategy
    least = min_training_devices(profile, devices, strategy)
    candidates = [
        i
        for i in _candidates(spec, devices, work.engine_devices)
        if profile.separate.fits(devices - i, strategy)
    ]
    if least is None or least > 1:
        notes.append(_memory_note(profile, devices, strategy, least))
    measured, most = spec.plan.iterations, _max_staleness(spec)
    for name in spec.plan.modes:
        mode, placement, n, partial = parse_mode(name)
        if partial and not engine_kind(work.batching).streams:
            note = f"{name}: partial rollouts need continuous batching; skipped"
            if note not in notes:
                notes.append(note)
            continue
        if placement == "colocated":
            if devices % work.devices_per_engine("colocated"):
                notes.append(f"{devices} devices: no whole number of colocated engines; skipped")
                continue
            if not profile.colocated.fits(devices, strategy):
                continue
            shape = Shape("sync", "colocated", devices, devices)
            mine = _lengths_for(lengths, 0, measured, most)
            results.append(simulate(shape, work, profile.colocated, mine, profile.tpspd_devices))
            continue
        if not candidates:
            note = (
                f"{devices} devices: no split between inference and training leaves the learner "
                "enough devices"
            )
            if note not in notes:
                notes.append(note)
            continue

        mine = _lengths_for(lengths, n, measured, most)

        def run(i: int, mode=mode, n=n, partial=partial, mine=mine) -> SimResult:
            shape = Shape(mode, "separate", i, devices - i, staleness=n, partial=partial)
            return simulate(shape, work, profile.separate, mine, profile.tpspd_devices)

        found = search_splits(candidates, run, exhaustive=bool(spec.plan.splits))
        results.extend(found[i] for i in sorted(found))
    if not results:
        why = f": {_memory_note(profile, devices, strategy, least)}" if least != 1 else ""
        raise ConfigError(
            f"plan key 'cluster.devices': nothing to simulate on {devices} devices{why}"
        )
    best: dict[str, SimResult] = {}
    for r in results:
        if r.shape.label not in best or r.tpspd > best[r.shape.label].tpspd:
            best[r.shape.label] = r
    return ClusterPlan(devices, results, best, recommend(results), least)


def min_training_devices(profile: Profile, devices: int, strategy: str) -> int | None:
    """The fewest training devices (learner ranks) whose memory holds the learner, of `devices`."""
    return next((d for d in range(1, devices + 1) if profile.separate.fits(d, strategy)), None)


def _memory_note(profile: Profile, devices: int, strategy: str, least: int | None) -> str:
    cost = profile.separate
    room = cost.train_memory_bytes / 1e9
    if least is None:
        need = cost.rank_memory(devices, strategy) / 1e9
        return (
            f"{devices} devices: the learner does not fit ({strategy}: {need:,.1f} GB per rank "
            f"even on all {devices}, {room:,.1f} GB allowed)"
        )
    need = cost.rank_memory(least - 1, strategy) / 1e9
    return (
        f"{devices} devices: the learner needs at least {least} training devices ({strategy}: "
        f"{need:,.1f} GB per rank on {least - 1}, {room:,.1f} GB allowed); smaller splits skipped"
    )


def recommend(results: list[SimResult]) -> SimResult:
    """The highest TPSPD; a tie (within TIE of it) goes to the less stale, then fewer engines."""
    top = max(r.tpspd for r in results)
    tied = [r for r in results if r.tpspd >= top * (1 - TIE)]
    return min(tied, key=lambda r: (_mean_staleness(r), r.shape.num_inference, -r.tpspd))


def _mean_staleness(r: SimResult) -> float:
    return sum(k * v for k, v in r.staleness.items()) / sum(r.staleness.values())


def _candidates(spec: PlanSpec, devices: int, engine_devices: int) -> list[int]:
    """Inference device counts: whole engines, and at least one training device."""
    allowed = list(range(engine_devices, devices, engine_devices))
    if spec.plan.splits:
        return [i for i in spec.plan.splits if i in allowed]
    return allowed


def search_splits(
    candidates: list[int], evaluate: Callable[[int], SimResult], exhaustive: bool = False
) -> dict[int, SimResult]:
    """Simulated splits by inference device count: all, or a coarse grid then a hill climb."""
    seen: dict[int, SimResult] = {}

    def tpspd(j: int) -> float:
        i = candidates[j]
        if i not in seen:
            seen[i] = evaluate(i)
        return seen[i].tpspd

    if exhaustive or len(candidates) <= EXHAUSTIVE_SPLITS:
        for j in range(len(candidates)):
            tpspd(j)
        return seen
    grid = sorted(set(np.linspace(0, len(candidates) - 1, 10).round().astype(int).tolist()))
    best = max(grid, key=tpspd)
    step = max(1, (grid[1] - grid[0]) // 2)
    while True:
        moved = True
        while moved:
            moved = False
            for j in (best - step, best + step):
                if 0 <= j < len(candidates) and tpspd(j) > tpspd(best):
                    best, moved = j, True
        if step == 1:
            return seen
        step //= 2
