"""The inference-engine seam: what an engine takes, what it returns, and how it draws randomness.

Sampling is reproducible per sample, not per batch: sample j of prompt i in iteration k draws its
randomness from a seed derived from (run seed, k, i, j), and the uniform for decoding step t is a
counter-based hash of (seed, t). No global RNG is touched, so the same completions come out whatever
the batch composition, the order, or the process that generates them.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from cadence.types import Completion


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # EOS and friends: the token is kept, decoding stops
    stop: tuple[str, ...] = ()  # stop strings: decoding stops once the text contains one


@dataclass
class Request:
    """Generate `len(seeds)` samples for one prompt, sample j seeded by `seeds[j]`.

    `max_new_tokens` caps this request below the params' own limit (a multi-turn episode's token
    budget); None: the params' limit alone."""

    prompt_ids: list[int]
    seeds: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None

    def limit(self, params: SamplingParams) -> int:
        """The most tokens a sample of this request may have under `params`."""
        if self.max_new_tokens is None:
            return params.max_new_tokens
        return min(self.max_new_tokens, params.max_new_tokens)


Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class RequestRefused(ValueError):
    """An engine would not take a request (a prompt longer than it holds, say): the request is
    not in the engine, and everything else in it goes on."""


class Engine(Protocol):
    """Turns requests into completions. `owns_weights` says where its weights live: False, it
    decodes with the model object it was given, so a change to that model's parameters is a
    change to the engine's (colocated with the learner, nothing needs copying); True, it keeps a
    copy of its own (vLLM) that new weights reach only through `load_weights` (`WeightOwner`)."""

    @property
    def owns_weights(self) -> bool: ...

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        """One list of completions per request, in request order, `len(seeds)` each."""
        ...


class WeightOwner(Engine, Protocol):
    """An engine with its own copy of the weights (`owns_weights` True)."""

    def load_weights(self, tensors: Tensors, version: int | str | None = None) -> None:
        """Put new weights, under the plain model's parameter names, into the engine's copy;
        `version` labels them. Only while idle: a request never sees two versions."""
        ...

    def held_fingerprint(self, expected: dict) -> dict:
        """The fingerprints (models/fingerprint.py) of the weights its copy holds now, of the
        tensors `expected` names that it holds under that name and shape."""
        ...


@runtime_checkable
class StreamingEngine(Protocol):
    """Work added at any time; each `step()` returns the requests that finished, by key."""

    occupancy: list[tuple[float, int]]  # (time.perf_counter(), sequences decoding), appended

    @property
    def owns_weights(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    def add(self, key: Hashable, request: Request, params: SamplingParams) -> None: ...

    def step(self) -> list[tuple[Hashable, list[Completion]]]: ...


@runtime_checkable
class InFlightWeights(Protocol):
    """A streaming engine that can take new weights between two steps while sequences decode
    (partial rollouts), and stamps every token with the version of the weights that computed the
    distribution it was sampled from (`Completion.token_versions`)."""

    def take_weights_in_flight(self, recompute: bool) -> None:
        """From now on new weights may arrive between two steps with sequences in flight: with
        `recompute` each of them is prefilled again under the new weights before its next token,
        else the keys and values computed under the old ones are kept. A treatment the engine
        does not offer raises ValueError."""
        ...

    @property
    def oldest_version(self) -> int | None:
        """The version of the oldest token of the requests in flight (None: none sampled yet)."""
        ...

    def weights_changed(self, version: int) -> None:
        """The weights it decodes with are now `version`'s (called between steps, once they are
        loaded): the tokens it samples from now on are stamped with it."""
        ...


@runtime_checkable
class Sleeps(Protocol):
    """An engine that keeps its own copy on a GPU and can free it while the learner trains
    (vLLM's sleep mode); it wakes by itself when next asked to load weights or to generate."""

    def sleep(self) -> None:
        """Free what generation holds on the GPU, if the platform can (else nothing)."""
        ...


@runtime_checkable
class Releases(Protocol):
    """An engine that can free what generation holds (its KV cache) between uses."""

    @property
    def busy(self) -> bool: ...

    def release(self) -> None:
        """While idle: free the cache; the next request allocates it again."""
        ...


@runtime_checkable
class TakesAdapters(Protocol):
    """An engine with its own copy that can also take a LoRA adapter beside its base weights
    (vLLM's LoRA requests): a LoRA policy's update then travels as the adapter alone."""

    @property
    def takes_adapters(self) -> bool:
        """Whether it was started able to take one (vLLM: `enable_lora`)."""
        ...

    def load_adapter(self, path: str, version: int | str | None = None) -> None:
        """Decode every later request with the adapter saved in `path` (peft's layout), read
        before this returns; `version` labels it. Only while idle, as `load_weights`."""
        ...

    def adapter_fingerprint(self) -> dict:
        """The fingerprints of the adapter later requests decode with, as it was read ({}:
        none)."""
        ...


class BatchStepper:
    """A batch-only Engine seen as a StreamingEngine: one step generates everything added."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: list[tuple[Hashable, Request]] = []
        self.params: SamplingParams | None = None
        self.occupancy: list[tuple[float, int]] = []

    @property
    def owns_weights(self) -> bool:
        return self.engine.owns_weights

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def add(self, key: Hashable, request: Request, params: SamplingParams) -> None:
        if self.pending and params != self.params:
            raise ValueError("one SamplingParams per step")
        self.params = params
        self.pending.append((key, request))

    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        pending, self.pending = self.pending, []
        if not pending:
            return []
        self.occupancy.append((time.perf_counter(), sum(len(r.seeds) for _, r in pending)))
        outputs = self.engine.generate([r for _, r in pending], self.params)
        self.occupancy.append((time.perf_counter(), 0))
        return [(key, out) for (key, _), out in zip(pending, outputs, strict=True)]


def release_cached_memory() -> None:
    """Return PyTorch's cached, unused GPU blocks to the device (nothing without CUDA): memory
    freed in this process stays in its caching allocator, where another allocator (vLLM's) or a
    process cannot have it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def as_streaming(engine: Engine) -> StreamingEngine:
    return engine if isinstance(engine, StreamingEngine) else BatchStepper(engine)


def generate_by_steps(
    engine: StreamingEngine, requests: list[Request], params: SamplingParams
) -> list[list[Completion]]:
    """The Engine Protocol's `generate` of a streaming engine: add every request, step until the
    engine is idle, and return the completions in request order."""
    if engine.busy:
        raise RuntimeError("generate() needs an idle engine (streaming work is in flight)")
    try:
        for i, r in enumerate(requests):
            engine.add(i, r, params)
    except RequestRefused:
        while engine.busy:  # the requests already added run out: the engine is left idle
            engine.step()
        raise
    out: dict[Hashable, list[Completion]] = {}
    while engine.busy:
        out.update(engine.step())
    return [out[i] for i in range(len(requests))]


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """`model` in eval mode for the duration (no dropout: a learner's model in train mode decodes
    as it would be evaluated), its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def derive_seed(run_seed: int, iteration: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, stable across processes and Python versions."""
    key = f"{run_seed}:{iteration}:{prompt_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def derive_turn_seed(seed: int, turn: int) -> int:
    """The seed of turn `turn` of a multi-turn sample whose first turn is seeded by `seed`:
    turn 0 keeps `seed` (a single-turn sample's), later turns hash (seed, turn)."""
    if turn == 0:
        return seed
    key = f"{seed}:turn:{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_M1 = _to_signed(0xBF58476D1CE4E5B9)
_M2 = _to_signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def step_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Uniforms in [0, 1) (R,), one per row: splitmix64 of seed + (step + 1) * golden."""
    x = seeds + torch.full_like(seeds, _GOLDEN) * (step + 1)  # int64 wraps, as splitmix64 wants
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    x = x ^ _srl(x, 31)
    return _srl(x, 11).to(torch.float64) / float(1 << 53)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last dimension, as the learner computes it: logits - logsumexp.

    Not `torch.log_softmax`: in float32 on CPU it adds the exponentials up in running sums, and
    once a peaked distribution's top token is in, the long tail of a large vocabulary is rounded
    away (on SmolLM2's 49,152 tokens log-probs came out 7e-6 high on average, up to 1.9e-5,
    against a float64 log softmax); logsumexp's sum keeps it (under 4e-6, unbiased).
    """
    return logits - logits.logsumexp(dim=-1, keepdim=True)


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling with one given uniform per row.

    Returns the sampled ids (R,) and their log-probs under softmax(logits / temperature) (R,), the
    distribution the learner recomputes (top-p only truncates where the sample may fall).
    """
    logits = logits.float()  # (R, V)
    if temperature <= 0:
        ids = logits.argmax(dim=-1)  # (R,)
        return ids, log_softmax(logits).gather(-1, ids[:, None]).squeeze(-1)
    logp = log_softmax(logits / temperature)  # (R, V)
    probs = logp.exp().double()  # (R, V)
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (R, V)
        keep = probs.cumsum(-1) - probs < top_p  # the first token is always kept
        probs = probs * keep
    cdf = probs.cumsum(-1)  # (R, V)
    target = (uniforms * cdf[:, -1])[:, None]  # (R, 1)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # (R, 1)
    ids = order.gather(-1, idx).squeeze(-1) if top_p < 1.0 else idx.squeeze(-1)  # (R,)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
