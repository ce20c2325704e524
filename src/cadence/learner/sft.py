"""Supervised warm start: train on reference solutions so RL starts from a non-zero reward.

The prompt and the answer are tokenized separately, exactly as RL sees them (prompt alone, then
response tokens), and the loss covers answer tokens and EOS only. A multi-turn demonstration
(`segments`: the answer as (text, trained) pieces, e.g. the policy's tool calls and the tool's
results) is tokenized piece by piece, as a rollout worker appends them, and only the policy's
pieces and EOS carry a loss. The result is cached: a marker
file records a key of the SFT and data settings and the base model, and a second call with the
same key does nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.data import Example, Render, as_render
from cadence.models import load_model, load_tokenizer, save_pretrained

MARKER = "sft.json"


def cache_key(sft: dict, data: dict, seed: int, base: Path) -> str:
    weights = sorted(p.name + str(p.stat().st_size) for p in base.glob("*.safetensors"))
    blob = json.dumps([sft, data, seed, weights], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_cached(out: Path, key: str) -> bool:
    marker = out / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("key") == key


Segments = Callable[[Example], list[tuple[str, bool]]]  # an answer as (text, trained) pieces


def whole_answer(example: Example) -> list[tuple[str, bool]]:
    return [(example.answer, True)]


def encode_batch(
    examples, tokenizer, template: str | Render, segments: Segments = whole_answer
) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, labels (-100 on prompt, untrained pieces and padding);
    right-padded. The prompt is rendered as RL renders it (`template`: a plain template or a chat
    renderer)."""
    render = as_render(template)
    rows = []
    for ex in examples:
        p = tokenizer(render(ex), add_special_tokens=False)["input_ids"]
        a, trained = [], []
        for text, train in segments(ex):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            a += piece
            trained += [train] * len(piece)
        rows.append((p, [*a, tokenizer.eos_token_id], [*trained, True]))
    width = max(len(p) + len(a) for p, a, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros_like(ids)  # (B, L)
    labels = torch.full_like(ids, -100)  # (B, L)
    for b, (p, a, trained) in enumerate(rows):
        n = len(p) + len(a)
        ids[b, :n] = torch.tensor(p + a)
        attn[b, :n] = 1
        kept = [t if keep else -100 for t, keep in zip(a, trained, strict=True)]
        labels[b, len(p) : n] = torch.tensor(kept)
    return ids, attn, labels


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine to 10%

    return f


def run_sft(
    task,
    template: str | Render,
    base: Path,
    out: Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    key: str,
    progress: bool = True,
    segments: Segments = whole_answer,
) -> dict:
    """Train `steps` steps of `batch_size` examples from `task.train_iter()`, save to `out`."""
    from rich.progress import Progress

    tokenizer = load_tokenizer(base)
    model = load_model(base).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, steps))
    examples = task.train_iter(0)
    start, loss_value = time.perf_counter(), float("nan")
    with Progress(disable=not progress) as bar:
        job = bar.add_task("SFT", total=steps)
        for _ in range(steps):
            batch = [next(examples) for _ in range(batch_size)]
            ids, attn, labels = encode_batch(batch, tokenizer, template, segments)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_value = loss.item()
            bar.update(job, advance=1, description=f"SFT loss {loss_value:.3f}")
    save_pretrained(model.eval(), tokenizer, out)
    record = {
        "key": key,
        "steps": steps,
        "final_loss": loss_value,
        "wall_s": time.perf_counter() - start,
    }
    (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return record
