"""The sharded learner's driver: `learner.ranks = N` ranks behind the Trainer seam.

Read on: docs/ranks.md.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from cadence.backend.placement import Placement
from cadence.backend.ranks import BUILD, LocalRanks, Ranks
from cadence.choices import loss_kind
from cadence.learner.params import LearnerParams
from cadence.learner.rank import Rank, RankSpec, Rendezvous, RoundReply, build_rank
from cadence.learner.scorer import Scored
from cadence.learner.steps import BadSteps, step_chunks, token_chunks
from cadence.learner.sums import iteration_stats
from cadence.metrics import TRAIN_SPANS
from cadence.metrics.trace import Span, Tracer


class _Sized(Protocol):
    @property
    def num_tokens(self) -> int: ...


T = TypeVar("T", bound=_Sized)


def split_round(groups: list[T], num_ranks: int, per_rank: int) -> list[list[T]]:
    """`groups` (at most `num_ranks * per_rank`) into one share per rank, at most `per_rank`
    each, balanced by tokens: longest first, each to the rank with the fewest tokens so far among
    those with room (the lowest rank on a tie). Each share keeps the groups' arrival order."""
    if len(groups) > num_ranks * per_rank:
        raise ValueError(f"{len(groups)} groups do not fit {num_ranks} ranks x {per_rank}")
    order = sorted(range(len(groups)), key=lambda i: (-groups[i].num_tokens, i))
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in order:
        room = [r for r in range(num_ranks) if len(shares[r]) < per_rank]
        rank = min(room, key=tokens.__getitem__)
        shares[rank].append(i)
        tokens[rank] += groups[i].num_tokens
    return [[groups[i] for i in sorted(share)] for share in shares]


class RankClient:
    """The driver's side of `Rank`: each method sends that call through the transport, to every
    rank (a round: to each its share), named by the Protocol's own method. Sends do not wait;
    `rounds` takes in every reply due, and the calls that return something wait for it."""

    def __init__(self, transport: Ranks) -> None:
        self.transport = transport
        self.num_ranks = transport.num_ranks

    def _send_all(self, method: Callable, *args: Any) -> None:
        for rank in range(self.num_ranks):
            self.transport.call(rank, method.__name__, *args)

    def begin(self, version: int) -> None:
        self._send_all(Rank.begin, version)

    def train_round(self, shares: list[list[Scored]], step: bool) -> None:
        for rank, share in enumerate(shares):
            self.transport.call(rank, Rank.train_round.__name__, share, step)

    def rounds(self) -> list[list[RoundReply]]:
        """Every reply due, per rank: the round replies among them, in order."""
        replies = self.transport.wait()
        return [[r for r in rank if isinstance(r, RoundReply)] for rank in replies]

    def poll(self) -> None:
        """Raise a rank's failure now, without waiting."""
        self.transport.poll()

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Rank 0's answer (each rank's last reply is the one to the call just sent)."""
        self._send_all(Rank.gather_weights)
        return self.transport.wait()[0][-1]

    def save(self, path: str) -> dict[str, Any]:
        self._send_all(Rank.save, path)
        return self.transport.wait()[0][-1]

    def load(self, path: str, state: dict[str, Any]) -> None:
        self._send_all(Rank.load, path, state)
        self.transport.wait()

    def describe(self) -> list[dict[str, Any]]:
        self._send_all(Rank.describe)
        return [replies[-1] for replies in self.transport.wait()]

    def close(self) -> None:
        self.transport.close()


class RankedLearner:
    """The learner as `transport.num_ranks` torch.distributed ranks (see the module docstring)."""

    def __init__(
        self,
        transport: Ranks,
        model: torch.nn.Module,
        params: LearnerParams,
        tracer: Tracer | None = None,
        clock_offsets: list[float] | None = None,
        strategy: str = "fsdp",
        on_close: Callable[[], None] | None = None,
        whole: bool = False,
    ) -> None:
        """Drive the ranks behind `transport`, built already; `model` is the driver's whole
        copy of the policy, `strategy` what the ranks run (recorded in checkpoints), `on_close`
        what to clean up once the ranks are stopped."""
        self.ranks, self.model, self.params = RankClient(transport), model, params
        self.num_ranks = transport.num_ranks
        self.tracer = tracer or Tracer()
        self.clock_offsets = clock_offsets or [0.0] * self.num_ranks  # rank clock -> ours
        self.strategy, self.on_close = strategy, on_close
        self.whole = whole  # a loss that reads its group: a token budget never splits one
        self.version = 0  # policy version: number of iterations trained
        self.bad_steps = BadSteps(params.max_bad_steps)
        self.described = self.ranks.describe()  # per rank: what it holds, its pid
        self.frozen_copies_bytes = self.described[0]["frozen_bytes"]  # per rank
        self._figures: list[list[dict[str, Any]]] = [[] for _ in range(self.num_ranks)]

    # --- training ---------------------------------------------------------------------------

    def train_iteration(self, scored: Iterable[Scored], num_groups: int) -> dict[str, Any]:
        """Train on `num_groups` scored groups as they come, in rounds; step after each
        mini-batch's last group (learner/steps.py: fewer may come, and what did is trained)."""
        start = self.tracer.now()
        self.ranks.begin(self.version)
        steps: list[dict[str, float]] = []
        for shares, ends_step in self._rounds(scored, num_groups):
            self._round(shares, step=ends_step, steps=steps)
        if not steps:
            raise RuntimeError(f"learner got no groups (expected {num_groups})")
        self._publish()
        self.version += 1
        return iteration_stats(steps, self.frozen_copies_bytes) | self._rank_figures(start)

    def _rounds(
        self, scored: Iterable[Scored], num_groups: int
    ) -> Iterator[tuple[list[list[Scored]], bool]]:
        """(each rank's share, ends a step): whole groups balanced by tokens, at most
        `micro_batch_groups` a rank; or with a token budget one packed micro-batch a rank."""
        p, n = self.params, self.num_ranks
        if not p.micro_batch_tokens:
            per_round = n * p.micro_batch_groups
            for chunk, ends in step_chunks(scored, num_groups, p.mini_batches, per_round):
                yield split_round(chunk, n, p.micro_batch_groups), ends
            return
        batches: list[list[Scored]] = []
        layout = p.shared_prompt_impl if p.shared_prompt else "unpacked"  # as the ranks ask
        budget = p.micro_batch_tokens
        chunks = token_chunks(scored, num_groups, p.mini_batches, budget, self.whole, layout)
        for batch, ends in chunks:
            batches.append(batch)
            if len(batches) == n or ends:
                yield batches + [[] for _ in range(n - len(batches))], ends
                batches = []

    def _round(self, shares: list[list[Scored]], step: bool, steps: list[dict[str, float]]) -> None:
        self.ranks.train_round(shares, step)
        if not step:
            self.ranks.poll()  # a failed rank stops the run now, not at the step
            return
        replies = self.ranks.rounds()
        for rank, rank_replies in enumerate(replies):
            for reply in rank_replies:
                self._take(rank, reply)
        figures = replies[0][-1].step
        assert figures is not None  # a round that steps answers with the step's figures
        self.bad_steps.count(bool(figures["skipped_steps"]))  # each rank counted them too
        steps.append(figures)

    def _take(self, rank: int, reply: RoundReply) -> None:
        """A rank's spans onto the run's timeline; its memory figures kept for the iteration."""
        offset = self.clock_offsets[rank] - self.tracer.origin
        for s in reply.spans:
            self.tracer.add(Span(s.name, s.track, s.start + offset, s.end + offset))
        self._figures[rank].append(reply.memory)

    def _rank_figures(self, since: float) -> dict[str, Any]:
        """Per rank: training busy time this iteration and peak memory; `learner_ranks`."""
        busy = [0.0] * self.num_ranks
        for s in self.tracer.select("learner-", since=since, names=TRAIN_SPANS):
            busy[int(s.track.rsplit("-", 1)[1])] += s.duration
        memory = [f[-1] if f else {} for f in self._figures]
        self._figures = [[] for _ in range(self.num_ranks)]
        out: dict[str, Any] = {"learner_ranks": self.num_ranks, "learner_rank_busy_s": busy}
        for key in memory[0]:
            per_rank = [m[key] for m in memory]
            out[f"learner_{key}"] = max(per_rank)
            out[f"learner_rank_{key}"] = per_rank
        return out

    def _publish(self) -> None:
        """Every rank gathers the parameters; rank 0's land in the driver's model."""
        with self.tracer.span("gather_weights", "learner"):
            arrays = self.ranks.gather_weights()
            if arrays is not None:  # Ray: numpy arrays through the object store
                load_arrays(self.model, arrays)

    # --- checkpoints ------------------------------------------------------------------------

    def state(self, directory: Path) -> dict[str, Any]:
        """Have every rank write its shards to `directory/learner`; what the checkpoint's state
        keeps besides: how many ranks wrote it and how, the version, the bad-step count, and
        the ranks' own (the schedule)."""
        rank = self.ranks.save(str(directory / SHARDS))
        return {
            "ranks": self.num_ranks,
            "strategy": self.strategy,
            "version": self.version,
            "bad_steps_in_a_row": self.bad_steps.in_a_row,
            "rank": rank,
        }

    def load_state(self, directory: Path, state: dict[str, Any]) -> None:
        """Continue from a checkpoint written by any number of ranks > 1 (the driver's model is
        loaded by the checkpoint)."""
        if state.get("ranks", 1) < 2:
            raise ValueError(
                f"{directory}: trainer state written by a single-process learner cannot be read "
                "by learner ranks (its optimizer state is not sharded)"
            )
        self.ranks.load(str(directory / SHARDS), state["rank"])
        self.version = state["version"]
        self.bad_steps.in_a_row = state["bad_steps_in_a_row"]

    def close(self) -> None:
        try:
            self.ranks.close()
        finally:
            if self.on_close is not None:
                self.on_close()


SHARDS = "learner"  # the checkpoint's subdirectory holding the ranks' shards
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}  # the group's own sockets


@torch.no_grad()
def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Copy rank 0's gathered parameters (numpy; bfloat16 as int16 bits) into `model`."""
    for name, p in model.named_parameters():
        t = torch.from_numpy(np.array(arrays[name]))  # a copy: the store's arrays are read-only
        p.copy_(t.view(p.dtype) if p.dtype == torch.bfloat16 else t)


def start_local_ranks(
    spec: RankSpec, model: torch.nn.Module, tracer: Tracer, placement: Placement | None = None
) -> RankedLearner:
    """`spec.world_size` rank processes on this machine, meeting through a file on loopback;
    rank 0 writes the gathered weights straight into `model`'s parameters (moved to shared
    memory). With `placement` rank r sees its own GPUs only and trains on the first (`cuda`);
    without, on the CPU."""
    model.share_memory()
    shared = dict(model.named_parameters())
    folder = tempfile.mkdtemp(prefix="cadence-ranks-")
    rendezvous = Rendezvous("file://" + str(Path(folder) / "store"), LOOPBACK)
    ranks = LocalRanks(
        build_rank,
        spec.world_size,
        spawn_args=lambda r: (spec, shared if r == 0 else None),
        timeout_s=spec.timeout_s,
        env=placement.rank_env if placement is not None else None,
    )
    try:
        for r in range(spec.world_size):
            ranks.call(r, BUILD, rendezvous, "cuda" if placement is not None else "cpu")
        ranks.wait()
        return RankedLearner(
            ranks,
            model,
            spec.params,
            tracer,
            strategy=spec.strategy,
            on_close=lambda: shutil.rmtree(folder, ignore_errors=True),
            whole=loss_kind(spec.algo.loss).whole_groups,
        )
    except BaseException:
        ranks.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise


def start_ray_ranks(
    spec: RankSpec,
    model: torch.nn.Module,
    tracer: Tracer,
    *,
    resources: dict[str, float],
    address: str | None = None,
    num_cpus: int = 0,
) -> RankedLearner:
    """`spec.world_size` rank actors in a placement group of `resources` per rank, meeting over
    TCP at rank 0's node (loopback on a Ray started for the run); rank 0 returns the gathered
    weights as numpy arrays. With GPUs in `resources` each rank trains on its own."""
    from cadence.backend.ray.ranks import RayRanks

    ranks = RayRanks(
        build_rank,
        spec.world_size,
        (spec, None),
        resources=resources,
        address=address,
        num_cpus=num_cpus,
        timeout_s=spec.timeout_s,
    )
    try:
        host, port = ranks.rendezvous_address()
        rendezvous = Rendezvous(f"tcp://{host}:{port}", LOOPBACK if host == "127.0.0.1" else {})
        device = "cuda" if resources.get("GPU") else "cpu"
        for r in range(spec.world_size):
            ranks.call(r, BUILD, rendezvous, device)
        ranks.wait()
        offsets = ranks.clock_offsets()
        whole = loss_kind(spec.algo.loss).whole_groups
        return RankedLearner(
            ranks, model, spec.params, tracer, offsets, strategy=spec.strategy, whole=whole
        )
    except BaseException:
        ranks.close()
        raise
