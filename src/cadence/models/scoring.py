"""Scores of responses under a model, as a teacher gives them: each response token's log-prob
after its prompt, and which of several teachers scores a prompt of a task. Pure torch on a
loaded model: it loads nothing and knows no config (the learner's teacher pass and the teacher
stage's workers both read it). docs/distillation.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

ANY_TASK = ""  # the key of a teacher that scores every prompt


def teacher_key(keys: Iterable[str], task: str) -> str:
    """The key of the teacher that scores a prompt of `task`, among the teachers' `keys`."""
    keys = list(keys)
    if ANY_TASK in keys:
        return ANY_TASK
    if task not in keys:
        raise ValueError(
            f"no teacher scores task {task!r}: [[distill.teachers]] name {sorted(keys)}"
        )
    return task


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float = 1.0,
    rows_per_pass: int = 8,
) -> list[list[float]]:
    """Each response's per-token log-probs under `model` after its prompt (softmax of logits /
    temperature), from right-padded passes of `rows_per_pass` rows: a teacher stage's scores,
    equal to the learner's own teacher pass within float error."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for first in range(0, len(responses), rows_per_pass):
        prompts = prompt_ids[first : first + rows_per_pass]
        answers = responses[first : first + rows_per_pass]
        rows = [[*p, *r] for p, r in zip(prompts, answers, strict=True)]
        ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)  # (B, L)
        attention = torch.zeros_like(ids)
        for b, row in enumerate(rows):
            ids[b, : len(row)], attention[b, : len(row)] = torch.tensor(row), 1
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
        for b, (p, r) in enumerate(zip(prompts, answers, strict=True)):
            if not r:
                out.append([])
                continue
            at = logits[b : b + 1, len(p) - 1 : len(p) - 1 + len(r)]  # (1, n, V)
            tokens = torch.tensor([list(r)], device=device)  # (1, n)
            logprobs = (at.float() / temperature).log_softmax(-1)  # (1, n, V)
            out.append(logprobs.gather(-1, tokens[:, :, None])[0, :, 0].tolist())
    return out
