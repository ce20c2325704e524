"""Helpers for the tests of partial rollouts: a second version of a model, and the log-probs a
sequence's tokens must have when its weights changed while it decoded.

Two references, one per way of treating the keys and values (engine/continuous.py):
- recompute: a token of version v has the log-prob that version v's weights give it over the
  whole prefix (a full forward, as the learner computes it);
- keep: the forward that reads token i (writing its keys and values) is the one that computes
  the logits of token i + 1, so it runs under the weights of token i + 1's version; the prompt is
  read under the first token's. Run token by token with a cache, that gives each token's
  log-prob under its own version over the keys and values its predecessors left.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache


def next_version(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` with every parameter moved by `scale` x N(0, 1): version v + 1."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def full_logprobs(model, prompt_ids, token_ids, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each token after the whole prefix, one forward (T,)."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature  # (T, V)
    logp = torch.log_softmax(logits, -1)  # (T, V)
    return logp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


@torch.no_grad()
def kept_cache_logprobs(models, prompt_ids, token_ids, versions, temperature: float):
    """The keep reference (module docstring): `models[v]` is version v's model (T,)."""
    cache = DynamicCache()
    prompt = torch.tensor([list(prompt_ids)])
    logits = models[versions[0]](prompt, past_key_values=cache, use_cache=True).logits[0, -1]
    out = []
    for i, tok in enumerate(token_ids):
        logp = torch.log_softmax(logits.float() / temperature, -1)  # (V,)
        out.append(logp[tok])
        if i + 1 == len(token_ids):
            break
        position = torch.tensor([[len(prompt_ids) + i]])
        step = models[versions[i + 1]](
            torch.tensor([[tok]]), past_key_values=cache, position_ids=position, use_cache=True
        )
        logits = step.logits[0, -1]
    return torch.stack(out)


def learner_logprobs(model, group, pad_id: int, temperature: float) -> list[torch.Tensor]:
    """Each completion's log-probs as the learner computes them (its own forward and layout) on a
    copy of `model`: one tensor per completion, over its tokens."""
    from cadence.algo import AlgoParams
    from cadence.learner import Learner, LearnerParams, score

    algo = AlgoParams(kl_coef=0.0)
    params = LearnerParams(temperature=temperature)
    learner = Learner(copy.deepcopy(model), params, algo, pad_id)
    seen = []
    inner = learner.forward.loss_fn
    learner.forward.loss_fn = lambda batch, p: (seen.append(batch), inner(batch, p))[1]
    learner.version = group.policy_version  # the learner's code takes the group as fresh
    learner.train_iteration(iter(score([group], algo)), 1)
    (batch,) = seen
    return [batch.logprobs[i, : len(c.token_ids)].detach() for i, c in enumerate(group.completions)]
