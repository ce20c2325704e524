"""Checks shared by the engine tests."""

from __future__ import annotations

import torch


def assert_behaviour_logprobs_match(model, requests, outputs, temperature: float) -> None:
    """Every sampled token's log-prob equals a full forward's under softmax(logits / T), 1e-5."""
    for req, group in zip(requests, outputs, strict=True):
        for c in group:
            ids = torch.tensor([req.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0].float() / temperature  # (L, V)
            start = len(req.prompt_ids)
            logp = torch.log_softmax(logits[start - 1 : -1], -1)  # (T, V)
            expected = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def recomputed_logprobs(model, prompt_ids, token_ids, temperature):
    """The learner's log-probs of `token_ids` after `prompt_ids` (softmax(logits / T), full
    forward), and each step's logits / T."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature  # (T, V)
    logp = torch.log_softmax(logits, -1)  # (T, V)
    return logp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1), logits


def max_logprob_diff(model, requests, outputs, temperature: float) -> float:
    """Largest |behaviour log-prob - recomputed log-prob| over every sampled token."""
    worst = 0.0
    for req, group in zip(requests, outputs, strict=True):
        for c in group:
            expected, _ = recomputed_logprobs(model, req.prompt_ids, c.token_ids, temperature)
            worst = max(worst, (torch.tensor(c.logprobs) - expected).abs().max().item())
    return worst
