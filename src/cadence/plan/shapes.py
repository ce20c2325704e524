"""A model's shape for the planner: from its directory's `config.json`, or, for a model a recipe
names before it is downloaded, from a table of common ones (their published configs).

Parameters are counted from the shape (embeddings, each decoder layer's attention, gated MLP and
norms, an output projection unless tied), as `transformers` builds a Llama, Qwen2 or Mistral
model. Nothing here reads weights or touches the network. docs/planner.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from cadence.config import ConfigError
from cadence.plan.costs import ModelShape

# name -> the config.json keys the shape needs (the models' published configs)
KNOWN = {
    "Qwen2.5-0.5B-Instruct": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2",
    ),
    "Qwen2.5-1.5B-Instruct": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2",
    ),
    "Qwen2.5-7B-Instruct": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2",
    ),
    "SmolLM2-135M-Instruct": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, model_type="llama",
    ),
    "Llama-3.1-8B-Instruct": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, model_type="llama",
    ),
}  # fmt: skip


def model_shape(path: str | Path, bytes_per_param: float = 2.0) -> ModelShape:
    """The shape of the model in `path`: its `config.json`, or where the directory is not there,
    the table's entry for its name; `ConfigError` when neither says."""
    p = Path(path)
    if (p / "config.json").is_file():
        config = json.loads((p / "config.json").read_text())
    elif p.name in KNOWN:
        config = KNOWN[p.name]
    else:
        raise ConfigError(
            f"model.path = '{p}' has no config.json, and the planner knows no model named "
            f"'{p.name}' (it knows {', '.join(sorted(KNOWN))}): download it first"
        )
    return shape_of(config, bytes_per_param)


def shape_of(config: dict, bytes_per_param: float = 2.0) -> ModelShape:
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = h // heads * config.get("num_key_value_heads", heads)
    inter, vocab = config.get("intermediate_size", 4 * h), config["vocab_size"]
    bias = h + 2 * kv if config.get("model_type") == "qwen2" else 0  # Qwen2's q, k, v biases
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h + bias
    untied = 0 if config.get("tie_word_embeddings", False) else vocab * h
    params = vocab * h + untied + layers * layer + h
    return ModelShape(params, layers, h, kv, bytes_per_param, inter, vocab)
