"""Load and save Hugging Face causal-LM directories (ours or a user's) the same way.

Loading never touches the network (`local_files_only`), and every failure names the directory and
what is wrong with it. Weights are written as safetensors only.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

# The config's `model.dtype` names, for the learner, workers and reward models alike.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter's directory (peft's layout)


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, or not a causal language model."""


def check_model_dir(path: str | Path) -> Path:
    """`path` as a model directory: a Hugging Face model, or a LoRA adapter (adapter_config.json)
    over one."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(
            f"model directory '{p}' does not exist; build the default with "
            f"`cadence init-model --preset tiny --out {p}` or point model.path at a local "
            "Hugging Face model directory"
        )
    if not (p / "config.json").is_file() and not (p / ADAPTER_CONFIG).is_file():
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
    try:  # trust_remote_code=False: never run a directory's own code, and never ask on stdin
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise _unreadable(p, "the tokenizer", e) from e
    if tok.pad_token_id is None:  # many causal LMs ship without one; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in '{p}' has no EOS token; set eos_token in its config")
    return tok


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`AutoModelForCausalLM.from_pretrained` with sdpa attention, in eval mode, on `device`.

    Refused with `ModelLoadError`: a directory whose config names another architecture (a
    sequence classifier, say, which the causal-LM class would load with a random head), one that
    lacks any weight of the causal LM, one that needs its own code (`trust_remote_code`), and
    weights that are truncated or hold anything but tensors.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    p = check_model_dir(path)
    if not (p / "config.json").is_file():  # a LoRA adapter (a LoRA run's final/)
        return _load_adapter(p, dtype, device)
    check_causal_lm(p)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            p,
            dtype=dtype,
            attn_implementation="sdpa",
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
        )
    except (OSError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        # no weights file, a truncated one, or pickled weights holding more than tensors
        raise ModelLoadError(f"cannot load weights from '{p}': {_first_line(e)}") from e
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"'{p}' lacks {len(missing)} weight(s) of {type(model).__name__} "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): they would be "
            "randomly initialised; point model.path at a complete causal-LM checkpoint"
        )
    return model.to(device).eval()


def max_positions(model) -> int | None:
    """The most positions `model` takes (prompt + response), or None where its config states no
    limit (`max_position_embeddings`: absent from, say, a state-space model's config)."""
    return getattr(model.config, "max_position_embeddings", None)


def check_causal_lm(p: Path):
    """The directory's config, if it describes a causal LM (else `ModelLoadError`)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:  # unknown model_type, or code of its own
        raise _unreadable(p, "the config", e) from e
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"'{p}' holds a '{config.model_type}' model, which is not a causal language model "
            "(AutoModelForCausalLM has no class for it)"
        )
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    other = [a for a in config.architectures or [] if a not in causal]
    if other:
        raise ModelLoadError(
            f"'{p}' holds a {', '.join(other)} (config.json 'architectures'), which is not a "
            "causal language model: loaded as one, its language-model head would be random. "
            "Point model.path at a causal LM (a ...ForCausalLM checkpoint)"
        )
    return config


def _unreadable(p: Path, what: str, e: BaseException) -> ModelLoadError:
    """The error for a config or tokenizer transformers would not load; one that needs the
    directory's own code (an `auto_map`) says that cadence never runs it."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            custom = "auto_map" in json.loads((p / name).read_text())
        except (OSError, ValueError):
            custom = False
        if custom:
            return ModelLoadError(
                f"'{p}' needs Python code of its own to load ('auto_map' in {name}); cadence "
                "never runs code from a model directory (trust_remote_code): use a model whose "
                "architecture transformers ships"
            )
    return ModelLoadError(f"cannot load {what} of '{p}': {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    """An exception's message up to its first blank line (transformers' run on for pages)."""
    return str(e).strip().split("\n\n")[0].replace("\n", " ")


def _load_adapter(p: Path, dtype: torch.dtype, device: str):
    """The base model named in the adapter's config, with the adapter merged in."""
    config = json.loads((p / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ModelLoadError(f"'{p / ADAPTER_CONFIG}' names no base_model_name_or_path")
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelLoadError(f"'{p}' holds a LoRA adapter: pip install 'cadence[lora]'") from None
    model = PeftModel.from_pretrained(load_model(base, dtype, device), str(p))
    return model.merge_and_unload().to(device).eval()


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
        shutil.rmtree(tmp)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    except BaseException:  # a full disk, say: no half-written copy is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
