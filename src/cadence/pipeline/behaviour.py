"""Behaviour policies a checkpoint must hold for an off-policy run to resume exactly.

Off-policy (max_staleness N >= 1), the producer runs ahead: when the learner checkpoints after
iteration c - 1, iterations c .. c + N - 1 may already be generating, each with the version that
admitted it (max(b - N, 0) for iteration b), all older than the learner's version c. A run resumed
from the checkpoint must generate them with those same versions, so the checkpoint holds their
published weights, and the resumed source publishes them again, in order, before its first
iteration. Only the versions some later checkpoint needs are kept, as CPU copies (N at most);
checkpoints then grow by as many copies of the published weights. The policies are weights only:
nothing here knows the learner, the optimizer or the loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class PublishedWeights(torch.nn.Module):
    """A kept version, published again as a model is (weight transports read only
    `named_parameters()`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = tensors  # not registered: no parameters of its own

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator:  # type: ignore[override]
        return iter(self.tensors.items())

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator:  # type: ignore[override]
        return iter(self.tensors.values())


class BehaviourPolicies:
    """The published weights of the versions that checkpoints every `checkpoint_every`
    iterations need, for a run of `iterations` (None: unbounded) and `max_staleness` N."""

    def __init__(self, max_staleness: int, checkpoint_every: int, iterations: int | None) -> None:
        self.n, self.every, self.iterations = max_staleness, checkpoint_every, iterations
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def needed(self, checkpoint: int) -> list[int]:
        """The versions generating the iterations a checkpoint after `checkpoint - 1` leaves
        begun but not trained."""
        end = checkpoint + self.n
        if self.iterations is not None:
            end = min(end, self.iterations)
        return sorted({max(b - self.n, 0) for b in range(checkpoint, end)})

    def published(self, version: int, model: torch.nn.Module) -> None:
        """`version` was just published from `model`: keep a copy if a later checkpoint needs
        it, and forget what none does (the checkpoint before `version` is taken)."""
        if not self.n or not self.every:
            return
        upcoming = (version // self.every + 1) * self.every  # the next checkpoint
        for v in [v for v in self.kept if v < upcoming - self.n]:
            del self.kept[v]
        if version >= upcoming - self.n:
            self.kept[version] = {
                name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()
            }

    def restore(self, saved: Sequence[dict[str, Any]]) -> list[tuple[int, PublishedWeights]]:
        """The versions a checkpoint held (`state(...)`'s list), in order, to publish again;
        kept as well, since the next checkpoint may need some of them."""
        out = []
        for entry in saved:
            version, tensors = int(entry["version"]), dict(entry["weights"])
            self.kept[version] = tensors
            out.append((version, PublishedWeights(tensors)))
        return sorted(out, key=lambda vw: vw[0])

    def state(self, checkpoint: int) -> list[dict[str, Any]]:
        """What a checkpoint after `checkpoint - 1` holds: each needed version's weights."""
        missing = [v for v in self.needed(checkpoint) if v not in self.kept]
        if missing:
            raise RuntimeError(
                f"checkpoint {checkpoint} needs the weights of versions {missing}, which were "
                f"not kept (kept: {sorted(self.kept)}; checkpoint_every = {self.every})"
            )
        return [{"version": v, "weights": self.kept[v]} for v in self.needed(checkpoint)]
