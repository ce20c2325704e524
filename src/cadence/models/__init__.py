"""Model and tokenizer I/O: the embedded default builder, loaders for any local HF directory, and
the GGUF converter that makes one from a llama.cpp file."""

from cadence.models.generation import generation_eos_ids, stop_token_ids
from cadence.models.gguf import ConversionError, convert_gguf
from cadence.models.io import (
    DTYPES,
    ModelLoadError,
    load_model,
    load_skeleton,
    load_tokenizer,
    max_positions,
    save_pretrained,
)
from cadence.models.presets import PRESETS, init_model, train_tokenizer

__all__ = [
    "DTYPES",
    "PRESETS",
    "ConversionError",
    "ModelLoadError",
    "convert_gguf",
    "generation_eos_ids",
    "init_model",
    "load_model",
    "load_skeleton",
    "load_tokenizer",
    "max_positions",
    "save_pretrained",
    "stop_token_ids",
    "train_tokenizer",
]
