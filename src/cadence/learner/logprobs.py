"""Per-token log-probs and entropy of responses under a model, in a micro-batch's layout.

Log-probs are of softmax(logits / temperature), the distribution the engine sampled from; the
entropy is of the same distribution, without gradient (a figure, not a loss term). The layout
(learner/packing.py) says how the tokens are laid out for the model and where each response
token's logits are.
"""

from __future__ import annotations

import torch

from cadence.learner.packing import Layout


def token_logprobs(
    model: torch.nn.Module,
    layout: Layout,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None) of the response `tokens` (B, T)."""
    pred = layout.logits(model).float() / temperature  # (B, T, V)
    log_z = pred.logsumexp(-1)  # (B, T)
    logprobs = pred.gather(-1, tokens[:, :, None]).squeeze(-1) - log_z  # (B, T)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        p = torch.softmax(pred, -1)  # (B, T, V)
        entropy = log_z - (p * pred).sum(-1)  # (B, T)
    return logprobs, entropy
