"""Load and save Hugging Face causal-LM directories (ours or a user's) the same way.

Loading never touches the network (`local_files_only`), and every failure names the directory and
what is wrong with it. Weights are written as safetensors only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, or not a causal language model."""


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(
            f"model directory '{p}' does not exist; build the default with "
            f"`cadence init-model --preset tiny --out {p}` or point model.path at a local "
            "Hugging Face model directory"
        )
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"'{p}' has no config.json: not a Hugging Face model directory")
    return p


def _quiet_transformers() -> None:
    """No per-load progress bars or hub chatter: they drown the run's own progress display."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.pad_token_id is None:  # many causal LMs ship without one; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in '{p}' has no EOS token; set eos_token in its config")
    return tok


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`AutoModelForCausalLM.from_pretrained` with sdpa attention, in eval mode, on `device`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    p = check_model_dir(path)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(p, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"'{p}' holds a '{config.model_type}' model, which is not a causal language model "
            "(AutoModelForCausalLM has no class for it)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
    except OSError as e:  # no weights file, or an unreadable one
        raise ModelLoadError(f"cannot load weights from '{p}': {e}") from e
    return model.to(device).eval()


def load_skeleton(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model of `path` on the meta device: its parameters' names, shapes and dtypes, without
    memory or weights (for an engine that loads the weights itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    config = AutoConfig.from_pretrained(check_model_dir(path), local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def save_pretrained(model, tokenizer, out: str | Path) -> Path:
    """Save model (safetensors) and tokenizer to `out`, writing to a temp dir then renaming."""
    _quiet_transformers()
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
