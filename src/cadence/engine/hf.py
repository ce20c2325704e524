"""Batched sampling from any Hugging Face causal LM with a KV cache.

One prefill per distinct prompt: the prompt's keys and values are computed once and repeated for
its G samples. Decoding runs the active rows as one batch; rows that finished are dropped from the
cache in batches (dropping costs a cache copy, so it waits until a quarter of the rows are done).
Each sampled token's log-prob under softmax(logits / temperature) is returned: the behaviour
log-prob the learner recomputes.

Must not: touch a global RNG (randomness comes from per-sample seeds, see engine/base.py), or keep
state between calls (the weights may change between any two calls).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cadence.engine.base import (
    Request,
    SamplingParams,
    eval_mode,
    sample_tokens,
    step_uniforms,
)
from cadence.types import Completion


class HFEngine:
    """Static batches: `model.generate`-style decoding of up to `max_num_seqs` sequences at a
    time, each batch ending with its slowest sequence."""

    owns_weights = False  # it decodes with `model`: whatever changes that model changes it

    def __init__(self, model, tokenizer, max_num_seqs: int = 256) -> None:
        self.model, self.tokenizer, self.max_num_seqs = model, tokenizer, max_num_seqs
        self.pad_id = tokenizer.pad_token_id

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        with eval_mode(self.model):  # no dropout, whatever mode its trainer left it in
            for chunk in self._chunks(requests):
                out.extend(self._generate_chunk(chunk, params))
        return out

    def _chunks(self, requests: list[Request]) -> Iterator[list[Request]]:
        chunk: list[Request] = []
        rows = 0
        for req in requests:
            if chunk and rows + len(req.seeds) > self.max_num_seqs:
                yield chunk
                chunk, rows = [], 0
            chunk.append(req)
            rows += len(req.seeds)
        if chunk:
            yield chunk

    @torch.inference_mode()
    def _generate_chunk(
        self, reqs: list[Request], params: SamplingParams
    ) -> list[list[Completion]]:
        device = next(self.model.parameters()).device
        logits, cache, mask, pos = self._prefill(reqs, device)
        counts = torch.tensor([len(r.seeds) for r in reqs], device=device)
        rep = torch.arange(len(reqs), device=device).repeat_interleave(counts)  # (R,)
        cache.batch_select_indices(rep)
        logits, mask, pos = logits[rep], mask[rep], pos[rep]  # (R, V), (R, L), (R,)
        seeds = torch.tensor([s for r in reqs for s in r.seeds], dtype=torch.int64, device=device)
        limits = [r.limit(params) for r in reqs for _ in r.seeds]
        tokens, logprobs, reasons = self._decode(logits, cache, mask, pos, seeds, params, limits)
        return self._to_completions(reqs, tokens, logprobs, reasons)

    def _prefill(self, reqs: list[Request], device: torch.device):
        """Left-padded prefill of the distinct prompts: last logits, cache, mask, next position."""
        lens = [len(r.prompt_ids) for r in reqs]
        width = max(lens)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)  # (P, L)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)  # (P, L)
        for i, r in enumerate(reqs):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt_ids)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp_(min=0)  # (P, L)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1], out.past_key_values, mask, mask.sum(-1)

    def _decode(self, logits, cache, mask, pos, seeds, params: SamplingParams, limits: list[int]):
        num_rows = seeds.shape[0]
        tokens: list[list[int]] = [[] for _ in range(num_rows)]
        logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        reasons = ["length"] * num_rows
        stop_ids = set(params.stop_token_ids)
        active = list(range(num_rows))  # batch position -> output row
        live = torch.ones(num_rows, dtype=torch.bool)  # batch rows still decoding
        for step in range(params.max_new_tokens):
            ids, lps = sample_tokens(
                logits, step_uniforms(seeds, step), params.temperature, params.top_p
            )  # (R,), (R,)
            for b, (tok, lp) in enumerate(zip(ids.tolist(), lps.tolist(), strict=True)):
                if not live[b]:
                    continue
                row = active[b]
                tokens[row].append(tok)
                logprobs[row].append(lp)
                if tok in stop_ids:
                    reasons[row], live[b] = "eos", False
                elif params.stop and self._hits_stop(tokens[row], params.stop):
                    reasons[row], live[b] = "stop", False
                elif len(tokens[row]) >= limits[row]:
                    live[b] = False  # "length"
            num_live = int(live.sum())
            if num_live == 0 or step == params.max_new_tokens - 1:
                break
            if len(active) - num_live >= max(1, len(active) // 4):
                keep = live.nonzero().squeeze(-1)  # (R',)
                cache.batch_select_indices(keep.to(mask.device))
                active = [active[i] for i in keep.tolist()]
                ids, mask, pos, seeds = ids[keep], mask[keep], pos[keep], seeds[keep]
                live = torch.ones(len(active), dtype=torch.bool)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # (R, L+1)
            out = self.model(
                input_ids=ids[:, None],
                attention_mask=mask,
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits, cache, pos = out.logits[:, -1], out.past_key_values, pos + 1
        return tokens, logprobs, reasons

    def _hits_stop(self, ids: list[int], stop: tuple[str, ...]) -> bool:
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _to_completions(self, reqs, tokens, logprobs, reasons) -> list[list[Completion]]:
        out, row = [], 0
        for r in reqs:
            group = []
            for _ in r.seeds:
                text = self.tokenizer.decode(tokens[row], skip_special_tokens=True)
                group.append(Completion(tokens[row], logprobs[row], text, reasons[row]))
                row += 1
            out.append(group)
        return out
