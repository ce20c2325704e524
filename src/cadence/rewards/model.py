"""A learned reward: a local Hugging Face sequence classifier scores (prompt, response) pairs.

The one stateful reward: it holds a model, so it is imported from here and not from
`cadence.rewards`, which stays free of torch. It never downloads anything.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError

from cadence.models.io import ModelLoadError, check_model_dir, load_tokenizer

CLASSIFIER_SUFFIX = "ForSequenceClassification"


def text_ids(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Prompt and response token ids as the policy sees them; EOS ends the response."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p, r


def pad_right(
    rows: Sequence[Sequence[int]], pad_id: int, max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, right-padded; rows longer than `max_length` keep their end."""
    rows = [list(r)[-max_length:] if max_length else list(r) for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros_like(ids)  # (B, L)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, : len(r)] = 1
    return ids, attn


def scores_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, num_labels) -> (B,): the regression output, or P(correct) with two labels."""
    if logits.shape[-1] == 1:
        return logits[:, 0].float()
    return logits.float().softmax(-1)[:, 1]


class RewardModel:
    """Scores batches of (prompt, response) with a sequence classifier, `batch_size` at a time."""

    def __init__(self, model, tokenizer, *, batch_size: int = 32, max_length: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        if model.config.pad_token_id is None:  # a decoder classifier pools by it; batches need it
            model.config.pad_token_id = tokenizer.pad_token_id
        self.batch_size = batch_size
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        batch_size: int = 32,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> RewardModel:
        return cls(
            load_reward_model(path, dtype, device), load_tokenizer(path), batch_size=batch_size
        )

    @torch.no_grad()
    def score_ids(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[float]:
        """One score per (prompt, response) pair, in the order given."""
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(response_ids)} responses")
        rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # less padding per batch
        scores = [0.0] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, attn = pad_right([rows[i] for i in chunk], self.pad_id, self.max_length)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device))
            for i, s in zip(chunk, scores_from_logits(logits.logits).tolist(), strict=True):
                scores[i] = s
        return scores

    def score_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """Score texts, tokenized as the policy sees them (see the module docstring)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        pairs = [text_ids(self.tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
        return self.score_ids([p for p, _ in pairs], [r for _, r in pairs])

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        """The `RewardFn` seam, one response at a time; the reference `answer` is not shown."""
        return self.score_texts([prompt], [completion])[0]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`AutoModelForSequenceClassification` from a local directory, checked, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging

    logging.disable_progress_bar()  # as for the policy: no per-load chatter over the run's own
    logging.set_verbosity_error()
    p = check_model_dir(path)
    try:  # trust_remote_code=False: never run a directory's own code, and never ask on stdin
        config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config of '{p}': {str(e).splitlines()[0]}") from e
    architectures = config.architectures or []
    if not any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures):
        raise ModelLoadError(
            f"'{p}' holds {architectures or 'a model of no named architecture'}, not a sequence "
            "classifier (a *ForSequenceClassification class); build a reward model with "
            f"`cadence init-reward-model --out {p}` or train one with a classification head"
        )
    if config.num_labels not in (1, 2):
        raise ModelLoadError(
            f"'{p}' has {config.num_labels} labels; a reward model needs 1 (a score) or 2 "
            "(incorrect, correct)"
        )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            p, dtype=dtype, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, SafetensorError) as e:  # no weights file, or an unreadable one
        raise ModelLoadError(f"cannot load weights from '{p}': {e}") from e
    return model.to(device).eval()
