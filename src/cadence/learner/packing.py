"""Micro-batch layouts: how a list of groups becomes model inputs, and how log-probs come back.

Read on: docs/learner.md#how-it-is-built.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor

from cadence.learner.checkpointing import no_cache, prefix_cache
from cadence.learner.logprobs import full_logprobs, install_head, logprob_head, remove_head
from cadence.learner.segments import install as install_segments
from cadence.learner.segments import segments
from cadence.types import Group

# (prompt_ids, [response_ids, ...]) per group: the only thing a layout needs to know
GroupTokens = tuple[Sequence[int], Sequence[Sequence[int]]]


def group_tokens(group: Group) -> GroupTokens:
    """What a layout reads of `group`: its prompt's ids and each response's."""
    return group.prompt_ids, [c.token_ids for c in group.completions]


class Layout(Protocol):
    tokens_computed: int  # real (non-padding) tokens one forward pass runs through the model
    positions_computed: int  # every position one forward pass runs, padding included

    def to(self, device: torch.device) -> Layout: ...

    valid: Tensor  # (B, T) response token t exists

    def logits(self, model: torch.nn.Module) -> Tensor:
        """(M, V): the logits that predict each response token that exists, in the order of
        `valid`'s True entries (row b, then column t): no row for a response's padding."""
        ...

    def logprobs(self, model: torch.nn.Module, tokens: Tensor, temperature: float) -> Tensor:
        """(B, T, 2): log-prob and entropy of response b's token t, from the model's
        `LogprobHead` (learner/logprobs.py), without the full logits."""
        ...


class _Movable:
    def to(self, device: torch.device):
        """A copy with every tensor field on `device`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()}
        return type(self)(**moved)


def _response_width(groups: Sequence[GroupTokens]) -> int:
    return max([len(r) for _, rs in groups for r in rs] + [1])


def _valid(groups: Sequence[GroupTokens]) -> Tensor:
    """(B, T) True on each response's own tokens, False on its padding."""
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])  # (B,)
    return torch.arange(_response_width(groups))[None, :] < lens[:, None]  # (B, T)


@dataclass
class Unpacked(_Movable):
    input_ids: Tensor  # (B, L) [prompt | response], right-padded
    attention_mask: Tensor  # (B, L)
    pred_index: Tensor  # (B, T) position in the row whose logits predict response token t
    valid: Tensor  # (B, T) response token t exists
    tokens_computed: int
    positions_computed: int

    @classmethod
    def build(cls, groups: Sequence[GroupTokens], pad_id: int) -> Unpacked:
        rows = [(p, r) for p, rs in groups for r in rs]
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
        attn = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
        for b, (p, r) in enumerate(rows):
            ids[b, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
            attn[b, : len(p) + len(r)] = 1
        starts = torch.tensor([len(p) for p, _ in rows])  # (B,)
        steps = torch.arange(_response_width(groups))  # (T,)
        pred = (starts[:, None] - 1 + steps[None, :]).clamp(max=width - 1)  # (B, T)
        return cls(ids, attn, pred, _valid(groups), int(attn.sum()), ids.numel())

    def logits(self, model: torch.nn.Module) -> Tensor:
        logits = model(
            input_ids=self.input_ids, attention_mask=self.attention_mask, **no_cache(model)
        ).logits
        rows = torch.arange(len(self.valid), device=logits.device)[:, None].expand_as(self.valid)
        return logits[rows[self.valid], self.pred_index[self.valid]]  # (M, V)

    def logprobs(self, model: torch.nn.Module, tokens: Tensor, temperature: float) -> Tensor:
        rows = torch.arange(len(tokens), device=tokens.device)  # (B,)
        with logprob_head(model).asking(rows, self.pred_index, tokens, temperature, self.valid):
            return model(
                input_ids=self.input_ids, attention_mask=self.attention_mask, use_cache=False
            ).logits


def shared_prompt_mask(prompt_len: int, response_lens: Sequence[int], width: int) -> Tensor:
    """(width, width) bool mask of one `[P | R1 | ... | RG]` row; True = may attend.

    Query q attends key k iff k <= q and k is a prompt token or in q's own response. Positions
    past the row's tokens (padding) attend only to themselves, so no softmax row is empty.
    """
    return row_mask([(prompt_len, response_lens)], width)


def row_mask(groups: Sequence[tuple[int, Sequence[int]]], width: int) -> Tensor:
    """(width, width) bool mask of a row of groups end to end, `[P1 | R11 ... | P2 | R21 ...]`,
    each given as (prompt length, response lengths); True = may attend. Query q attends key k
    iff k <= q, both are of one group, and k is that group's prompt or q's own response; padding
    attends only to itself, so no softmax row is empty."""
    group, segment = [], []
    for g, (prompt_len, lens) in enumerate(groups):
        group += [g] * (prompt_len + sum(lens))
        segment += [0] * prompt_len + [j + 1 for j, n in enumerate(lens) for _ in range(n)]
    if len(group) > width:
        raise ValueError(f"row of {len(group)} tokens does not fit width {width}")
    pad = [-1] * (width - len(group))
    grp, seg = torch.tensor(group + pad), torch.tensor(segment + pad)  # (L,) -1 marks padding
    pos = torch.arange(width)  # (L,)
    causal = pos[None, :] <= pos[:, None]  # (L, L) [q, k]
    own = (grp[None, :] == grp[:, None]) & (grp[:, None] >= 0)  # (L, L) one group's, not padding
    visible = (seg[None, :] == 0) | (seg[None, :] == seg[:, None])  # (L, L)
    return (causal & own & visible) | torch.eye(width, dtype=torch.bool)


def shared_prompt_positions(prompt_len: int, response_lens: Sequence[int]) -> list[int]:
    """Position ids of a `[P | R1 | ... | RG]` row: each response continues from len(P)."""
    out = list(range(prompt_len))
    for n in response_lens:
        out.extend(range(prompt_len, prompt_len + n))
    return out


@dataclass
class Dense(_Movable):
    """Shared-prompt rows with a 4-D mask: by default one `[P | R1 | ... | RG]` row per group,
    right-padded to the longest; given `rows`, several groups end to end in a row (`packed`)."""

    input_ids: Tensor  # (N, L) rows of [P | R1 | ... | RG] groups, right-padded
    position_ids: Tensor  # (N, L) restarting with each group, each response after its prompt
    attention_mask: Tensor  # (N, 1, L, L) additive float mask: 0 = attend, dtype min = not;
    # or the rows' segments, (N, 1, 2, L) int64 (learner/segments.py)
    pred_row: Tensor  # (B,) row of each response
    pred_col: Tensor  # (B, T) column whose logits predict response token t
    valid: Tensor  # (B, T) response token t exists
    tokens_computed: int
    positions_computed: int

    @classmethod
    def build(
        cls,
        groups: Sequence[GroupTokens],
        pad_id: int,
        dtype: torch.dtype = torch.float32,
        rows: Sequence[Sequence[int]] | None = None,
        segmented: bool = False,
    ) -> Dense:
        """`segmented`: the attention mask is the rows' segments (learner/segments.py), read
        group by group by the attention itself, instead of a (row x row) mask."""
        rows = rows if rows is not None else [[g] for g in range(len(groups))]
        costs = [len(p) + sum(len(r) for r in rs) for p, rs in groups]
        width = max(sum(costs[g] for g in row) for row in rows)
        steps = _response_width(groups)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (N, L)
        pos = torch.zeros((len(rows), width), dtype=torch.long)  # (N, L)
        shapes = [
            [(len(groups[g][0]), [len(r) for r in groups[g][1]]) for g in row] for row in rows
        ]
        if not segmented:
            allowed = torch.zeros((len(rows), 1, width, width), dtype=torch.bool)  # (N, 1, L, L)
        start: dict[int, tuple[int, int]] = {}  # group -> (its row, its first column)
        for n, row in enumerate(rows):
            tokens: list[int] = []
            positions: list[int] = []
            for g in row:
                p, rs = groups[g]
                start[g] = (n, len(tokens))
                tokens += [*p, *(t for r in rs for t in r)]
                positions += shared_prompt_positions(len(p), [len(r) for r in rs])
            ids[n, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            pos[n, : len(tokens)] = torch.tensor(positions)
            if not segmented:
                allowed[n, 0] = row_mask(shapes[n], width)
        pred_row, pred_col = [], []
        for g, (p, rs) in enumerate(groups):  # responses in group order, as the batch has them
            n, first = start[g]
            offset = first + len(p)
            for r in rs:
                # token 0 is predicted by the prompt's last position, token t by the one before it
                col = [first + len(p) - 1] + [offset + t - 1 for t in range(1, steps)]
                pred_col.append([min(c, width - 1) for c in col])
                pred_row.append(n)
                offset += len(r)
        if segmented:
            install_segments()
            mask = segments(shapes, width)  # (N, 1, 2, L)
        else:
            # An additive mask, not a bool one: eager attention adds the mask to the scores and
            # would read a bool mask as 0/1 offsets (wrong); every implementation reads this.
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
                ~allowed, torch.finfo(dtype).min
            )
        pred = (torch.tensor(pred_row), torch.tensor(pred_col))
        return cls(ids, pos, mask, *pred, _valid(groups), sum(costs), ids.numel())

    def logits(self, model: torch.nn.Module) -> Tensor:
        logits = model(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            use_cache=False,
        ).logits  # (N, L, V)
        rows = self.pred_row[:, None].expand_as(self.pred_col)  # (B, T)
        return logits[rows[self.valid], self.pred_col[self.valid]]  # (M, V)

    def logprobs(self, model: torch.nn.Module, tokens: Tensor, temperature: float) -> Tensor:
        head = logprob_head(model)
        with head.asking(self.pred_row, self.pred_col, tokens, temperature, self.valid):
            return model(
                input_ids=self.input_ids,
                attention_mask=self.attention_mask,
                position_ids=self.position_ids,
                use_cache=False,  # nothing to keep; a cache would grow when a layer runs again
            ).logits  # (B, T, 2)


@dataclass
class Prefix(_Movable):
    prompt_ids: Tensor  # (N, W) left-padded, so every prompt's last token is in column W-1
    prompt_mask: Tensor  # (N, W)
    prompt_positions: Tensor  # (N, W)
    response_ids: Tensor  # (B, T) right-padded
    response_mask: Tensor  # (B, W + T) its prompt's mask, then its own tokens
    response_positions: Tensor  # (B, T) continuing from len(P)
    group_index: Tensor  # (B,) the group (prompt row) of each response
    valid: Tensor  # (B, T) response token t exists
    tokens_computed: int
    positions_computed: int

    @classmethod
    def build(cls, groups: Sequence[GroupTokens], pad_id: int) -> Prefix:
        width = max(len(p) for p, _ in groups)
        steps = _response_width(groups)
        n = len(groups)
        prompt_ids = torch.full((n, width), pad_id, dtype=torch.long)  # (N, W)
        prompt_mask = torch.zeros((n, width), dtype=torch.long)  # (N, W)
        responses = [(g, r) for g, (_, rs) in enumerate(groups) for r in rs]
        response_ids = torch.full((len(responses), steps), pad_id, dtype=torch.long)  # (B, T)
        own_mask = torch.zeros((len(responses), steps), dtype=torch.long)  # (B, T)
        for g, (p, _) in enumerate(groups):
            prompt_ids[g, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[g, width - len(p) :] = 1
        for b, (_, r) in enumerate(responses):
            response_ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            own_mask[b, : len(r)] = 1
        group_index = torch.tensor([g for g, _ in responses])  # (B,)
        prompt_lens = prompt_mask.sum(-1)  # (N,)
        real = int(prompt_lens.sum() + own_mask.sum())
        return cls(
            prompt_ids,
            prompt_mask,
            (prompt_mask.cumsum(-1) - 1).clamp(min=0),  # (N, W)
            response_ids,
            torch.cat([prompt_mask[group_index], own_mask], dim=1),  # (B, W + T)
            prompt_lens[group_index, None] + torch.arange(steps)[None, :],  # (B, T)
            group_index,
            own_mask.bool(),
            real,
            prompt_ids.numel() + response_ids.numel(),
        )

    def logits(self, model: torch.nn.Module) -> Tensor:
        prompt = self._prompt(model)
        first = prompt.logits[self.group_index, -1:]  # (B, 1, V) predicts response token 0
        rest = self._responses(model, prompt.past_key_values).logits  # (B, T, V)
        # (B, T, V): position t predicts token t + 1; the padding's rows dropped
        return torch.cat([first, rest[:, :-1]], dim=1)[self.valid]  # (M, V)

    def logprobs(self, model: torch.nn.Module, tokens: Tensor, temperature: float) -> Tensor:
        head, b, t = logprob_head(model), tokens.shape[0], tokens.shape[1]
        zeros = torch.zeros((b, 1), dtype=torch.long, device=tokens.device)  # (B, 1)
        with head.asking(self.group_index, zeros, tokens[:, :1], temperature, self.valid[:, :1]):
            prompt = self._prompt(model)  # its one kept position predicts response token 0
        rows = torch.arange(b, device=tokens.device)  # (B,)
        cols = torch.arange(t - 1, device=tokens.device).expand(b, -1)  # (B, T-1)
        with head.asking(rows, cols, tokens[:, 1:], temperature, self.valid[:, 1:]):
            rest = self._responses(model, prompt.past_key_values).logits  # (B, T-1, 2)
        return torch.cat([prompt.logits, rest], dim=1)  # (B, T, 2)

    def _prompt(self, model: torch.nn.Module):
        return model(
            input_ids=self.prompt_ids,
            attention_mask=self.prompt_mask,
            position_ids=self.prompt_positions,
            past_key_values=prefix_cache(),  # safe under activation checkpointing
            use_cache=True,
            logits_to_keep=1,
        )

    def _responses(self, model: torch.nn.Module, cache):
        return model(
            input_ids=self.response_ids,
            attention_mask=self.response_mask,
            position_ids=self.response_positions,
            # each prompt's K/V repeated for its responses, read without keeping theirs
            past_key_values=cache.for_responses(self.group_index),
            use_cache=True,
        )


def packed(groups: Sequence[GroupTokens], pad_id: int) -> Dense:
    """Padding-free: the micro-batch's groups end to end in one row, positions restarting with
    each group, each group attending only to itself through attention by segments
    (learner/segments.py): no padding and no (row x row) mask; its positions computed are its
    tokens computed."""
    return Dense.build(groups, pad_id, rows=[list(range(len(groups)))], segmented=True)


LAYOUTS: dict[str, Callable[[Sequence[GroupTokens], int], Layout]] = {
    "unpacked": Unpacked.build,
    "dense": Dense.build,
    "prefix": Prefix.build,
    "packed": packed,
}


def positions(name: str, groups: Sequence[GroupTokens]) -> int:
    """The positions layout `name` computes for `groups` in one pass (its `positions_computed`),
    from their lengths alone: what a token budget bounds."""
    if not groups:
        return 0
    costs = [len(p) + sum(len(r) for r in rs) for p, rs in groups]
    responses = [len(r) for _, rs in groups for r in rs]
    longest = max([*responses, 1])
    if name == "packed":
        return sum(costs)
    if name == "dense":
        return len(groups) * max(costs)
    if name == "prefix":
        return len(groups) * max(len(p) for p, _ in groups) + len(responses) * longest
    return len(responses) * max(len(p) + len(r) for p, rs in groups for r in rs)


def check_layout(model: torch.nn.Module, name: str, pad_id: int) -> str | None:
    """Why layout `name` gives wrong log-probs with `model` (None when it agrees with `unpacked`).

    Runs a tiny ragged batch (two groups, prompts of 3 and 5 tokens, responses of 1-4 tokens) both
    ways under no_grad. A model whose forward rejects the layout's inputs, or mis-reads its mask,
    is caught here once instead of training on wrong log-probs.
    """
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    groups = [(ids(3), [ids(2), ids(4)]), (ids(5), [ids(1), ids(3)])]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = Unpacked.build(groups, pad_id).to(device).logits(model).float()
            got = LAYOUTS[name](groups, pad_id).to(device).logits(model).float()
    except Exception as e:  # any failure means this model cannot take the layout
        return f"its forward failed: {type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    diff = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()  # (M, V) each
    dtype = next(model.parameters()).dtype
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not diff <= tolerance:
        return f"its log-probs differ from the unpacked forward by {diff:.2e} (> {tolerance:g})"
    return None


def install_checked_head(model: torch.nn.Module, chunk: int, pad_id: int) -> None:
    """A `LogprobHead` of `chunk` tokens on `model` (learner/logprobs.py), kept only where its
    log-probs are the full logits' on a tiny ragged batch; else the model's own head stays, and
    a warning says why. A model sharing another's head (a LoRA reference) keeps it as is."""
    if logprob_head(model) is not None:
        return
    reason = install_head(model, chunk)
    if reason is None:
        reason = _head_differs(model, pad_id)
        if reason is not None:
            remove_head(model)
    if reason is not None:
        warnings.warn(
            f"learner.logits_chunk_tokens: log-probs from the full logits for this model "
            f"({reason}); set learner.logits_chunk_tokens = 0 to silence this",
            stacklevel=4,
        )


def _head_differs(model: torch.nn.Module, pad_id: int) -> str | None:
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(1)
    groups = [([1, 2, 3], [[4, 5], [6, 7, 8]]), ([9, 10], [[11]])]
    groups = [
        ([int(i) for i in torch.randint(0, vocab, (len(p),), generator=gen)], rs)
        for p, rs in groups
    ]
    layout = Unpacked.build(groups, pad_id).to(next(model.parameters()).device)
    tokens = torch.tensor([[4, 5, 0], [6, 7, 8], [11, 0, 0]]) % vocab  # (B, T)
    tokens = tokens.to(layout.input_ids.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want, _ = full_logprobs(model, layout, tokens, 1.0, False)
            got = layout.logprobs(model, tokens, 1.0)[..., 0]
    except Exception as e:
        return f"its forward failed: {type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    diff = (got - want)[layout.valid].abs().max().item()  # padding: 0 from the head, unasked
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return None if diff <= tolerance else f"its head's log-probs differ by {diff:.2e}"
