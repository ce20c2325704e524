"""Random-init tiny models of real architectures for tests (no tokenizer, no files), and other
weights for a model the tests already have."""

from __future__ import annotations

import torch


def tiny_causal_lm(
    arch: str, vocab_size: int, attn: str = "sdpa", max_positions: int = 256, **extra
) -> torch.nn.Module:
    """A 2-layer Llama or Qwen2 (hidden 64, 4 heads, 2 KV heads), seeded, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        attn_implementation=attn,
        **extra,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()


def perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """A copy of `model` (its shape, so its tokenizer) with seeded noise of `scale` added to
    every weight: a teacher, or another policy, that differs from it."""
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def classifier_dir(model_dir, out, arch: str):
    """A random sequence classifier beside `model_dir`'s tokenizer (untied embeddings)."""
    import shutil

    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    small = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    if arch == "llama":
        cfg = LlamaConfig(
            **small, num_attention_heads=2, num_labels=1, tie_word_embeddings=False, pad_token_id=0
        )
        LlamaForSequenceClassification(cfg).save_pretrained(out)
    else:
        BertForSequenceClassification(BertConfig(**small, num_attention_heads=2)).save_pretrained(
            out
        )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


def save_vllm_ready(out, arch: str = "llama") -> str:
    """A tiny model directory vLLM's CPU attention can run (head size 32: it has no kernel for the
    'test' preset's 16), with the arithmetic task's BPE tokenizer. The Llama ties its output
    layer to the input embedding (as the embedded default does); the Qwen2 does not."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from cadence.data import ArithmeticTask
    from cadence.models import save_pretrained, train_tokenizer

    tokenizer = train_tokenizer(ArithmeticTask(difficulty=1, seed=0).corpus(2000))
    torch.manual_seed(0)
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=arch == "llama",
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    save_pretrained(model, tokenizer, out)
    return str(out)
