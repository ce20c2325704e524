"""The embedded default: a tiny Llama-architecture model with a BPE tokenizer of its own.

Real weights cannot be downloaded here, so `cadence init-model` builds a small model of a real
architecture from `transformers` and a byte-level BPE tokenizer trained with `tokenizers` on the
task's text, and saves both in the standard Hugging Face layout. Nothing downstream knows the model
was built here: every command loads it through `load_model`/`load_tokenizer`, like a user's own.

Llama rather than Qwen2: with a `qwen2` config `AutoTokenizer` swaps in Qwen's own pre-tokenizer and
the token ids change (shared/NOTES.md); a Llama config keeps the trained tokenizer as saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# A small chat template, so that `data.chat_template = true` works on the embedded model as on an
# instruct model's tokenizer: each turn is "<|role|>\ncontent\n", and the generation prompt opens
# the assistant's turn. The markers are plain text (no new special tokens: ids stay as trained).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# name -> LlamaConfig fields. "tiny" is the default workload; "test" is 3-5x faster, for tests;
# "small" (~110M) is a random-init model of a size where a GPU matters.
PRESETS: dict[str, dict[str, int]] = {
    "test": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4),
    "tiny": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4
    ),
    "small": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12
    ),
}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE on `texts`; digits are split one by one (arithmetic needs it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE
    )


def llama_config(preset: str, tokenizer, max_positions: int = 1024, **extra):
    """The LlamaConfig of `preset` for `tokenizer`'s vocabulary and special tokens."""
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}'; allowed: {', '.join(PRESETS)}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **PRESETS[preset],
        **extra,
    )


def build_model(preset: str, tokenizer, seed: int = 0, max_positions: int = 1024):
    """A randomly initialised LlamaForCausalLM sized by `preset`."""
    from transformers import LlamaForCausalLM

    config = llama_config(preset, tokenizer, max_positions)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def init_model(preset: str, out: str | Path, corpus: Iterable[str], seed: int = 0) -> Path:
    """Build tokenizer + model and save them to `out` in the Hugging Face layout."""
    from cadence.models.io import save_pretrained

    tokenizer = train_tokenizer(corpus)
    model = build_model(preset, tokenizer, seed=seed)
    return save_pretrained(model, tokenizer, out)
