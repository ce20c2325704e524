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
