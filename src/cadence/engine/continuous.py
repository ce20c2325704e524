"""Continuous batching: a finished sequence's slot is refilled at once, groups leave as they finish.

Active slots are kept as the prefix [0, n) of the slot tensors (a retired slot is filled by moving
the last active one into it), so a step reads a view, never a gather. Sampling is per sample as in
engine/base.py (seed and decoding step), so a sample's tokens do not depend on its slot, on when it
was admitted, or on its batch companions.

Read on: docs/engines.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from cadence.engine.base import (
    Request,
    SamplingParams,
    eval_mode,
    generate_by_steps,
    sample_tokens,
    step_uniforms,
)
from cadence.types import Completion

PREFILL_BATCH = 8  # prompts prefilled together when one is needed (their K/V wait until admitted)
RECOMPUTE_BATCH = 32  # sequences prefilled again together when new weights arrive (recompute)


class UnsupportedModel(RuntimeError):
    """The model's cache is not one plain full-attention layer per layer (e.g. sliding windows)."""


class _SlotLayer(CacheLayerMixin):
    """One layer's K/V for every slot; `update` writes row i at position `pos[i]`."""

    is_sliding = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot tensors are allocated by SlotCache.allocate")

    def update(self, key_states, value_states, *args, **kwargs):
        n, pos, width = self.owner.rows, self.owner.pos, self.owner.width
        rows = torch.arange(n, device=pos.device)
        self.keys[rows, :, pos] = key_states[:, :, 0]  # (n, H, D)
        self.values[rows, :, pos] = value_states[:, :, 0]
        return self.keys[:n, :, :width], self.values[:n, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.keys.shape[2] if self.keys is not None else -1


class SlotCache(Cache):
    """Preallocated per-slot K/V for all layers; `begin_step` says which rows decode where."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])
        self.rows, self.width = 0, 0
        self.pos = torch.zeros(0, dtype=torch.long)

    def allocate(self, slots: int, length: int, like: list[tuple[torch.Tensor, torch.Tensor]]):
        """(Re)allocate to (slots, H, length, D) per layer, keeping what is already there."""
        for layer, (k, v) in zip(self.layers, like, strict=True):
            old = (layer.keys, layer.values)
            layer.keys = k.new_zeros((slots, k.shape[0], length, k.shape[-1]))
            layer.values = v.new_zeros((slots, v.shape[0], length, v.shape[-1]))
            if old[0] is not None:
                keep = min(old[0].shape[2], length)
                layer.keys[:, :, :keep] = old[0][:, :, :keep]
                layer.values[:, :, :keep] = old[1][:, :, :keep]
            layer.is_initialized = True

    @property
    def length(self) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[2]

    def write_prefix(self, slot: int, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.layers, prefix, strict=True):  # k: (H, P, D)
            layer.keys[slot, :, : k.shape[1]] = k
            layer.values[slot, :, : v.shape[1]] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` positions to slot `dst` (the rest is never read)."""
        for layer in self.layers:
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]

    def begin_step(self, rows: int, pos: torch.Tensor, width: int) -> None:
        self.rows, self.pos, self.width = rows, pos, width


@dataclass(eq=False)
class _Job:
    """A request inside the engine: its samples' completions fill in as they finish."""

    key: Hashable
    request: Request
    completions: list[Completion | None]
    admitted: int = 0  # samples given a slot so far
    remaining: int = 0  # samples not yet finished
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (H, P, D)
    first_logits: torch.Tensor | None = None  # (V,) next-token logits after the prompt
    prefix_version: int = 0  # the weights that computed `prefix` and `first_logits`
    oldest: int | None = None  # the version of its oldest token sampled so far


@dataclass
class _Slot:
    job: _Job
    sample: int
    logits_version: int  # the weights that computed the slot's next-token logits
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ContinuousEngine:
    """Slot-based continuous batching over any Hugging Face causal LM with full attention.

    Streaming use: `add(key, request, params)` any time, then `step()` until `busy` is False;
    each step returns the (key, completions) of requests that finished. `generate` (the Engine
    Protocol) does that for a list of requests and returns them in order.
    """

    owns_weights = False  # it decodes with `model`: whatever changes that model changes it

    def __init__(self, model, tokenizer, max_num_seqs: int = 256) -> None:
        self.model, self.tokenizer, self.max_num_seqs = model, tokenizer, max_num_seqs
        self.pad_id = tokenizer.pad_token_id
        self.params: SamplingParams | None = None
        self.waiting: deque[_Job] = deque()
        self.slots: list[_Slot] = []  # active slots, in slot order
        self.cache: SlotCache | None = None
        self.occupancy: list[tuple[float, int]] = []  # (time.perf_counter(), active slots) per step
        self.version = 0  # of the weights `model` holds: stamped on the tokens they sample
        self.recompute: bool | None = None  # new weights in flight: None, refused; else how
        self._logits = self._seeds = self._steps = self._pos = self._last = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.slots)

    @property
    def num_active(self) -> int:
        return len(self.slots)

    @property
    def oldest_version(self) -> int | None:
        """The oldest version of a token in flight, sampled or to be sampled from logits already
        computed (a waiting prompt's prefill kept across new weights too); None: none."""
        versions = [j.oldest for j in self.waiting if j.oldest is not None]
        versions += [
            v for s in self.slots for v in (s.job.oldest, s.logits_version) if v is not None
        ]
        versions += [j.prefix_version for j in self.waiting if j.prefix is not None]
        return min(versions, default=None)

    def take_weights_in_flight(self, recompute: bool) -> None:
        """Allow new weights between steps while busy, keeping or recomputing the keys and
        values of the sequences in flight (see the module docstring)."""
        self.recompute = recompute

    @torch.inference_mode()
    def weights_changed(self, version: int) -> None:
        """`model` now holds `version`'s weights (see the module docstring); call between steps."""
        if self.busy and self.recompute is None:
            raise RuntimeError(
                f"weights of version {version} arrived with sequences in flight: "
                "take_weights_in_flight first (partial rollouts)"
            )
        self.version = version
        if not self.recompute:
            return
        for job in self.waiting:  # prefilled under the old weights: prefill again when admitted
            job.prefix = job.first_logits = None
        for i in range(0, len(self.slots), RECOMPUTE_BATCH):
            self._recompute(range(i, min(i + RECOMPUTE_BATCH, len(self.slots))))

    def _recompute(self, rows: range) -> None:
        """Prefill slots `rows` again, prompt and tokens so far, under the current weights: their
        keys and values and next-token logits."""
        seqs = [self.slots[s].job.request.prompt_ids + self.slots[s].tokens for s in rows]
        prefixes, logits = run_prefixes(self.model, self.pad_id, self._device(), seqs)
        for s, prefix, last in zip(rows, prefixes, logits, strict=True):
            self.cache.write_prefix(s, prefix)
            self._logits[s] = last
            self.slots[s].logits_version = self.version

    def add(self, key: Hashable, request: Request, params: SamplingParams) -> None:
        if self.busy and params != self.params:
            raise ValueError("a ContinuousEngine decodes with one SamplingParams at a time")
        self.params = params
        job = _Job(key, request, [None] * len(request.seeds), remaining=len(request.seeds))
        if job.remaining == 0:
            raise ValueError("a request needs at least one seed")
        self.waiting.append(job)

    def release(self) -> None:
        """Free the KV cache and the slots' tensors while idle; the next request allocates them
        again (held-out evaluation every few iterations need not keep a cache sized for its
        prompts resident between)."""
        if self.busy:
            raise RuntimeError("release() while requests decode")
        self.cache = None
        self._logits = self._seeds = self._steps = self._pos = self._last = None

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        return generate_by_steps(self, requests, params)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        """Admit, sample a token per active slot, retire, decode; in eval mode (no dropout)."""
        with eval_mode(self.model):
            self._admit()
            if not self.slots:
                return []
            self.occupancy.append((time.perf_counter(), len(self.slots)))
            done = self._retire(self._sample())
            if self.slots:
                self._forward()
            else:
                self.occupancy.append((time.perf_counter(), 0))
            return done

    # --- admission -------------------------------------------------------------------------

    def _admit(self) -> None:
        free = self.max_num_seqs - len(self.slots)
        plan: list[tuple[_Job, int]] = []
        for job in self.waiting:
            if free == 0:
                break
            take = min(free, len(job.completions) - job.admitted)
            plan.append((job, take))
            free -= take
        if not plan:
            return
        todo = [job for job, _ in plan if job.prefix is None]
        if todo:  # prefill a few waiting prompts ahead too: one batched forward, not several
            ahead = [j for j in self.waiting if j.prefix is None and all(j is not t for t in todo)]
            self._prefill(todo + ahead[: max(0, PREFILL_BATCH - len(todo))])
        for job, take in plan:
            for _ in range(take):
                self._place(job, job.admitted)
                job.admitted += 1
            if job.admitted == len(job.completions):
                self.waiting.popleft()  # plan follows the queue's order
                job.prefix = job.first_logits = None

    def _prefill(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        seqs = [j.request.prompt_ids for j in jobs]
        prefixes, logits = run_prefixes(self.model, self.pad_id, self._device(), seqs)
        for j, prefix, last in zip(jobs, prefixes, logits, strict=True):
            j.prefix, j.first_logits, j.prefix_version = prefix, last, self.version
        longest = max(len(j.request.prompt_ids) for j in jobs)
        self._ensure_capacity(longest + self.params.max_new_tokens, jobs[0])

    def _ensure_capacity(self, length: int, like: _Job) -> None:
        if self.cache is None:
            self.cache = SlotCache(len(like.prefix))
            s, device = self.max_num_seqs, self._device()
            self._logits = like.first_logits.new_zeros((s, like.first_logits.shape[0]))  # (S, V)
            self._seeds = torch.zeros(s, dtype=torch.long, device=device)
            self._steps = torch.zeros(s, dtype=torch.long, device=device)
            self._pos = torch.zeros(s, dtype=torch.long, device=device)
            self._last = torch.zeros(s, dtype=torch.long, device=device)
        if length > self.cache.length:
            self.cache.allocate(self.max_num_seqs, length + 16, like.prefix)  # rare: longer prompt

    def _place(self, job: _Job, sample: int) -> None:
        s = len(self.slots)
        self.cache.write_prefix(s, job.prefix)
        self._logits[s] = job.first_logits
        self._seeds[s] = job.request.seeds[sample]
        self._steps[s] = 0
        self._pos[s] = len(job.request.prompt_ids)
        self.slots.append(_Slot(job, sample, job.prefix_version))

    # --- decoding --------------------------------------------------------------------------

    def _sample(self) -> list[tuple[int, str]]:
        n, p = len(self.slots), self.params
        uniforms = step_uniforms(self._seeds[:n], self._steps[:n])  # (n,)
        ids, lps = sample_tokens(self._logits[:n], uniforms, p.temperature, p.top_p)  # (n,), (n,)
        self._last[:n] = ids
        self._steps[:n] += 1
        finished = []
        for s, (tok, lp) in enumerate(zip(ids.tolist(), lps.tolist(), strict=True)):
            slot = self.slots[s]
            slot.tokens.append(tok)
            slot.logprobs.append(lp)
            slot.versions.append(slot.logits_version)
            if slot.job.oldest is None or slot.logits_version < slot.job.oldest:
                slot.job.oldest = slot.logits_version
            if reason := finish_reason(self.tokenizer, slot.tokens, slot.job.request.limit(p), p):
                finished.append((s, reason))
        return finished

    def _retire(self, finished: list[tuple[int, str]]) -> list[tuple[Hashable, list[Completion]]]:
        done = []
        for s, reason in sorted(finished, reverse=True):  # from the end: moves stay valid
            slot = self.slots[s]
            text = self.tokenizer.decode(slot.tokens, skip_special_tokens=True)
            slot.job.completions[slot.sample] = Completion(
                slot.tokens, slot.logprobs, text, reason, token_versions=slot.versions
            )
            slot.job.remaining -= 1
            if slot.job.remaining == 0:
                done.append((slot.job.key, slot.job.completions))
            last = len(self.slots) - 1
            if s != last:
                self.cache.move(last, s, int(self._pos[last]))
                for t in (self._logits, self._seeds, self._steps, self._pos, self._last):
                    t[s] = t[last]
                self.slots[s] = self.slots[last]
            self.slots.pop()
        return done[::-1]

    def _forward(self) -> None:
        n = len(self.slots)
        pos = self._pos[:n]  # (n,) where each slot's newest token goes
        width = int(pos.max()) + 1
        keys = torch.arange(width, device=pos.device)  # (W,)
        dtype = self._logits.dtype
        mask = torch.zeros((n, 1, 1, width), dtype=dtype, device=pos.device)  # (n, 1, 1, W)
        mask.masked_fill_((keys[None, :] > pos[:, None])[:, None, None, :], torch.finfo(dtype).min)
        self.cache.begin_step(n, pos, width)
        out = self.model(
            input_ids=self._last[:n, None],
            attention_mask=mask,
            position_ids=pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self._logits[:n] = out.logits[:, -1]  # (n, V)
        self._pos[:n] += 1
        for slot in self.slots:
            slot.logits_version = self.version

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def run_prefixes(
    model, pad_id: int, device: torch.device, seqs: list[list[int]]
) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]]:
    """One left-padded forward over `seqs`: each one's keys and values per layer (H, L, D)
    and its next-token logits (V,)."""
    lens = [len(seq) for seq in seqs]
    width = max(lens)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (P, W)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (P, W)
    for i, seq in enumerate(seqs):
        ids[i, width - lens[i] :] = torch.tensor(seq)
        mask[i, width - lens[i] :] = 1
    ids, mask = ids.to(device), mask.to(device)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp_(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    layers = out.past_key_values.layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        raise UnsupportedModel(
            f"continuous batching needs plain full-attention caches, got "
            f"{sorted({type(layer).__name__ for layer in layers})}"
        )
    prefixes, logits = [], []
    for i in range(len(seqs)):  # keys were rotated by their own positions: copy as they are
        start = width - lens[i]
        prefixes.append(
            [(la.keys[i, :, start:].clone(), la.values[i, :, start:].clone()) for la in layers]
        )
        logits.append(out.logits[i, -1].clone())
    return prefixes, logits


def finish_reason(tokenizer, tokens: list[int], limit: int, p: SamplingParams) -> str | None:
    """Why a sequence ends at its last token: "eos" (a stop token), "stop" (a stop string in
    its last 16 tokens' text), "length" (`limit` tokens), or None: it goes on."""
    if tokens[-1] in p.stop_token_ids:
        return "eos"
    if p.stop and any(
        s in tokenizer.decode(tokens[-16:], skip_special_tokens=True) for s in p.stop
    ):
        return "stop"
    if len(tokens) >= limit:
        return "length"
    return None
