"""Random-init tiny models of real architectures for tests (no tokenizer, no files)."""

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
