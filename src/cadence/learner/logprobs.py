"""Per-token log-probs and entropy of responses, without a [B, T, V] float32 logits tensor.

`LogprobHead` takes the place of a causal LM's output projection (the same weight: names and
ties unchanged). Asked for tokens (`asking`), it returns their log-probs under softmax(logits /
temperature) and the distribution's entropy instead of the logits, computed `chunk` tokens at a
time: logits in the compute dtype, a float32 log-sum-exp, and for the backward only the hidden
states and the log-sum-exp kept, each chunk's logits computed again (as Liger's fused linear
cross-entropy does). Unasked it is the plain projection (generation). A model whose head is not
a plain projection keeps its own (`install_head` says why) and the full logits are used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


class ChunkedLogprobs(torch.autograd.Function):
    """(log-probs (M,), entropy (M,)) of `tokens` (M,) from `hidden` (M, H) and the projection
    `weight` (V, H), `chunk` rows at a time; the entropy carries no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk):  # type: ignore[override]
        m = hidden.shape[0]
        logprobs = hidden.new_empty(m, dtype=torch.float32)  # (M,)
        entropy = hidden.new_empty(m, dtype=torch.float32)  # (M,)
        lse = hidden.new_empty(m, dtype=torch.float32)  # (M,)
        for s in range(0, m, chunk):
            logits = (hidden[s : s + chunk] @ weight.T).float() / temperature  # (c, V)
            lse[s : s + chunk] = logits.logsumexp(-1)
            z = lse[s : s + chunk, None]  # (c, 1)
            picked = logits.gather(-1, tokens[s : s + chunk, None]).squeeze(-1)  # (c,)
            logprobs[s : s + chunk] = picked - z.squeeze(-1)
            entropy[s : s + chunk] = z.squeeze(-1) - (torch.exp(logits - z) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        hidden, weight, tokens, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad_logprobs[s : s + chunk].float()  # (c, H), (c,)
            logits = (h @ weight.T).float() / t  # (c, V)
            dlogits = torch.exp(logits - lse[s : s + chunk, None]).mul_(-g[:, None])  # (c, V)
            dlogits.scatter_add_(-1, tokens[s : s + chunk, None], g[:, None])
            dlogits = (dlogits / t).to(weight.dtype)  # what autograd feeds the projection
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = dlogits @ weight
            if grad_weight is not None:
                grad_weight += (dlogits.T @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


class LogprobHead(torch.nn.Module):
    """A causal LM's output projection that can return chosen tokens' log-probs instead of the
    logits (see the module docstring). `weight` is the projection's own Parameter."""

    def __init__(self, weight: torch.nn.Parameter, chunk: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk = chunk
        self.request: tuple[Tensor, Tensor, Tensor, float, Tensor | None] | None = None

    @contextlib.contextmanager
    def asking(
        self,
        rows: Tensor,
        cols: Tensor,
        tokens: Tensor,
        temperature: float,
        valid: Tensor | None = None,
    ) -> Iterator[None]:
        """While open, a forward returns (B, T, 2): log-prob and entropy of token `tokens[b, t]`
        as predicted at row `rows[b]`, position `cols[b, t]` of the hidden states; with `valid`
        (B, T) only where it is True (a response's own tokens: padding costs no projection),
        0 elsewhere."""
        self.request = (rows, cols, tokens, temperature, valid)
        try:
            yield
        finally:
            self.request = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.request is None:
            return torch.nn.functional.linear(hidden, self.weight)
        rows, cols, tokens, temperature, valid = self.request
        picked = hidden[rows[:, None], cols].flatten(0, 1)  # (B * T, H)
        flat = tokens.flatten()  # (B * T,)
        keep = None if valid is None else valid.flatten().nonzero().squeeze(-1)  # (M,)
        if keep is not None:
            picked, flat = picked[keep], flat[keep]  # (M, H), (M,)
        lp, ent = ChunkedLogprobs.apply(picked, self.weight, flat, temperature, self.chunk)
        if keep is not None:
            zeros = lp.new_zeros(tokens.numel())  # (B * T,)
            lp, ent = zeros.index_put((keep,), lp), zeros.index_put((keep,), ent)
        shape = tokens.shape
        return torch.stack([lp.view(shape), ent.view(shape)], -1)  # (B, T, 2), not a view


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside `model` (a DDP wrapper's module, a peft model's base,
    the policy under `AdapterOff`)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "policy", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def install_head(model: torch.nn.Module, chunk: int) -> str | None:
    """Put a `LogprobHead` of `chunk` tokens in place of `model`'s `lm_head`; why not (None: it
    is in place). Only a plain bias-free linear projection named `lm_head` is replaced."""
    lm = causal_lm(model)
    head = getattr(lm, "lm_head", None)
    if isinstance(head, LogprobHead):
        head.chunk = chunk
        return None
    if head is None:
        return "it has no lm_head"
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its output projection is a {type(head).__name__}, not a bias-free Linear"
    lm.lm_head = LogprobHead(head.weight, chunk)
    return None


def remove_head(model: torch.nn.Module) -> None:
    """Give `model` back a plain projection on the head's weight."""
    lm = causal_lm(model)
    head = lm.lm_head
    linear = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=False, device="meta")
    linear.weight = head.weight
    lm.lm_head = linear


def logprob_head(model: torch.nn.Module) -> LogprobHead | None:
    head = getattr(causal_lm(model), "lm_head", None)
    return head if isinstance(head, LogprobHead) else None


def from_logits(
    logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The same from full logits (B, T, V): the path of a model whose head stays its own."""
    pred = logits.float() / temperature  # (B, T, V)
    log_z = pred.logsumexp(-1)  # (B, T)
    logprobs = pred.gather(-1, tokens[:, :, None]).squeeze(-1) - log_z  # (B, T)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        entropy = log_z - (torch.softmax(pred, -1) * pred).sum(-1)  # (B, T)
    return logprobs, entropy


def token_logprobs(
    model: torch.nn.Module, layout, tokens: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None) of the response `tokens` in `layout`: through
    the model's `LogprobHead` where it has one, else from the full logits."""
    if logprob_head(model) is None:
        return full_logprobs(model, layout, tokens, temperature, with_entropy)
    out = layout.logprobs(model, tokens, temperature)  # (B, T, 2)
    return out[..., 0], out[..., 1].detach() if with_entropy else None


def full_logprobs(
    model: torch.nn.Module, layout, tokens: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` from the full logits of the response tokens that exist ((M, V): no row
    for a response's padding, whose positions hold 0)."""
    valid = layout.valid  # (B, T)
    flat, entropy = from_logits(
        layout.logits(model)[None], tokens[valid][None], temperature, with_entropy
    )

    def spread(values: Tensor) -> Tensor:  # (1, M) -> (B, T)
        out = values.new_zeros(valid.shape)
        out[valid] = values[0]
        return out

    return spread(flat), spread(entropy) if entropy is not None else None
