"""The embedded default's reward model: a tiny classifier trained on the task's own answers.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import torch

from cadence.data import Example, Task, make_prompt, reference_answer
from cadence.models import load_tokenizer, save_pretrained
from cadence.models.presets import llama_config
from cadence.rewards.model import RewardModel, pad_right, text_ids

MARKER = "reward_model.json"
LABELS = {0: "incorrect", 1: "correct"}


def wrong_answer(answer: str, rng: random.Random) -> str | None:
    """`answer` with its final number moved by 1-3; None when the final answer is no integer."""
    head, _, _ = answer.rpartition("####")
    try:
        final = int(reference_answer(answer).replace(",", ""))
    except ValueError:
        return None
    deltas = [d for d in (-3, -2, -1, 1, 2, 3) if final < 0 or final + d >= 0]
    return f"{head}#### {final + rng.choice(deltas)}"


def labelled_pairs(
    examples: Iterator[Example], n: int, rng: random.Random
) -> list[tuple[Example, str]]:
    """`n` (example, wrong answer) pairs, skipping examples whose answer cannot be perturbed."""
    pairs = ((e, wrong_answer(e.answer, rng)) for e in examples)
    return list(islice(((e, w) for e, w in pairs if w is not None), n))


def build_reward_model(preset: str, tokenizer, seed: int = 0):
    """A random-init LlamaForSequenceClassification with two labels, sized by `preset`."""
    from transformers import LlamaForSequenceClassification

    config = llama_config(
        preset, tokenizer, num_labels=2, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}
    )
    config.architectures = [LlamaForSequenceClassification.__name__]
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


def pair_loss(logits: torch.Tensor) -> torch.Tensor:
    """Positives first, then their negatives in the same order: CE + Bradley-Terry."""
    n = logits.shape[0] // 2
    labels = torch.cat([torch.ones(n), torch.zeros(n)]).long()  # (2n,)
    log_odds = logits[:, 1] - logits[:, 0]  # (2n,)
    pairwise = -torch.nn.functional.logsigmoid(log_odds[:n] - log_odds[n:]).mean()
    return torch.nn.functional.cross_entropy(logits, labels) + pairwise


def _row(tokenizer, prompt: str, answer: str) -> list[int]:
    p, r = text_ids(tokenizer, prompt, answer)
    return p + r


def heldout_check(reward: RewardModel, pairs: Sequence[tuple[Example, str]], template: str):
    """Accuracy on positives and negatives at P(correct) = 0.5, and pairwise accuracy."""
    prompts = [make_prompt(e.question, template) for e, _ in pairs]
    pos = reward.score_texts(prompts, [e.answer for e, _ in pairs])
    neg = reward.score_texts(prompts, [w for _, w in pairs])
    right = sum(p > 0.5 for p in pos) + sum(q < 0.5 for q in neg)
    return {
        "heldout_accuracy": right / (2 * len(pairs)),
        "heldout_pairwise_accuracy": sum(p > q for p, q in zip(pos, neg, strict=True)) / len(pos),
    }


def train_reward_model(
    task: Task,
    template: str,
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    preset: str = "test",
    steps: int = 400,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    num_heldout: int = 200,
) -> dict:
    """Train on `steps` x `batch_size` texts of `task`'s stream, check on its held-out set, save
    model and tokenizer to `out`; return the figures (also written to `out/reward_model.json`)."""
    if batch_size < 2 or batch_size % 2:
        raise ValueError(f"batch_size must be even and >= 2 (pairs); got {batch_size}")
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_reward_model(preset, tokenizer, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    stream = task.train_iter(0)
    start, loss = time.perf_counter(), float("nan")
    for _ in range(steps):
        pairs = labelled_pairs(stream, batch_size // 2, rng)
        prompts = [make_prompt(e.question, template) for e, _ in pairs]
        answers = [e.answer for e, _ in pairs] + [w for _, w in pairs]
        rows = [_row(tokenizer, p, a) for p, a in zip(prompts * 2, answers, strict=True)]
        ids, attn = pad_right(rows, tokenizer.pad_token_id)
        step_loss = pair_loss(model(input_ids=ids, attention_mask=attn).logits)
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = step_loss.item()
    train_s = time.perf_counter() - start
    heldout = labelled_pairs(iter(task.heldout()), num_heldout, random.Random(seed + 1))
    figures = heldout_check(RewardModel(model, tokenizer), heldout, template)
    save_pretrained(model, tokenizer, out)
    record = {"preset": preset, "steps": steps, "final_loss": loss, "train_s": train_s}
    record |= figures | {"num_heldout": len(heldout)}
    (Path(out) / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return record
