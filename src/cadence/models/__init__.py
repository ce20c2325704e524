"""Model and tokenizer I/O: the embedded default builder and loaders for any local HF directory."""

from cadence.models.build import PRESETS, init_model, train_tokenizer
from cadence.models.io import (
    ModelLoadError,
    load_model,
    load_skeleton,
    load_tokenizer,
    save_pretrained,
)

__all__ = [
    "PRESETS",
    "ModelLoadError",
    "init_model",
    "load_model",
    "load_skeleton",
    "load_tokenizer",
    "save_pretrained",
    "train_tokenizer",
]
