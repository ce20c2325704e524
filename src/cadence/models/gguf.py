"""Convert a GGUF file (llama.cpp's one-file checkpoint) into a Hugging Face model directory.

It must not keep quantised weights (the learner trains dense float32), touch the network, or
replace a directory that is not a model.

Read on: docs/smollm2.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cadence.models.io import ModelLoadError, check_causal_lm, max_positions

GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (any version)

# llama.cpp's pre-tokenizers that split every numeric character on its own before the GPT-2 split
# (`"\\p{N}"` first in llama-vocab.cpp), as those models' own tokenizer.json does with a `Digits`
# pre-tokenizer; transformers builds these byte-level tokenizers with the plain GPT-2 split, which
# tokenises runs of numerals such as "½¾" or " ²" unlike the model's training.
PRE_TOKENIZER_DIGITS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)


class ConversionError(ModelLoadError):
    """A GGUF file cadence cannot convert, or an output directory it must not replace."""


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file's metadata says about the model, read before the slow load."""

    path: Path
    architecture: str  # llama.cpp's name: 'llama', 'qwen2', ...
    tokenizer_model: str | None  # 'gpt2' (byte-level BPE), 'llama' (sentencepiece), ...
    tokenizer_pre: str | None  # llama.cpp's pre-tokenizer name: 'smollm', 'llama-bpe', ...
    end_of_turn_ids: tuple[int, ...]  # llama.cpp's eot/eom tokens, where the file names them
    num_tensors: int


@dataclass(frozen=True)
class Converted:
    """The directory `convert_gguf` wrote, and what is in it."""

    out: Path
    model_type: str
    num_parameters: int
    vocab_size: int
    eos_token: str
    stop_token_ids: tuple[int, ...]  # generation_config.json's eos_token_id
    chat_template: bool
    seconds: float


def convert_gguf(
    gguf_file: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Converted:
    """Convert `gguf_file` into a Hugging Face directory `out` (float32 safetensors, tokenizer,
    chat template, generation config). `out` may be absent or empty; one holding a model is
    replaced only with `force`. Errors: `ConversionError`, naming the file or directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: nothing to ask the hub
    say = progress or (lambda _: None)
    start = time.perf_counter()
    out = check_out_dir(out, force)
    info = read_gguf_info(gguf_file)
    if out.exists() and info.path.resolve().is_relative_to(out.resolve()):
        raise ConversionError(
            f"the GGUF file '{gguf_file}' is inside --out '{out}': replacing that directory "
            "would delete the file it is converted from; choose another --out"
        )
    size_mb = info.path.stat().st_size / 1e6
    say(f"{info.path.name}: {info.architecture}, {info.num_tensors} tensors, {size_mb:.0f} MB")
    _quiet_transformers()
    say(f"dequantising {info.num_tensors} tensors to float32")
    model = load_gguf_model(info)
    say("building the tokenizer")
    tokenizer = load_gguf_tokenizer(info, max_positions(model))
    stops = _set_special_tokens(model, tokenizer, info)
    say(f"writing {out}")
    _write_atomically(out, lambda tmp: _save(model, tokenizer, tmp))
    return Converted(
        out=out,
        model_type=model.config.model_type,
        num_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        eos_token=tokenizer.eos_token,
        stop_token_ids=stops,
        chat_template=bool(tokenizer.chat_template),
        seconds=time.perf_counter() - start,
    )


def read_gguf_info(gguf_file: str | Path) -> GgufInfo:
    """The metadata of `gguf_file`, or `ConversionError` if it is missing or not a GGUF file."""
    path = Path(gguf_file)
    if not path.is_file():
        raise ConversionError(f"GGUF file '{path}' does not exist (or is not a file)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConversionError(
            f"'{path}' is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}"
        )
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:  # truncated or corrupt
        raise ConversionError(
            f"cannot read GGUF file '{path}' (truncated?): {_first_line(e)}"
        ) from e

    def field(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    ends = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return GgufInfo(
        path=path,
        architecture=field("general.architecture") or "",
        tokenizer_model=field("tokenizer.ggml.model"),
        tokenizer_pre=field("tokenizer.ggml.pre"),
        end_of_turn_ids=tuple(dict.fromkeys(i for i in ends if i is not None)),
        num_tensors=len(reader.tensors),
    )


def check_out_dir(out: str | Path, force: bool) -> Path:
    """`out` if the conversion may write it: absent, an empty directory, or (with `force`) a
    directory holding a model. Anything else is refused, `force` or not."""
    p = Path(out)
    if not p.exists():
        return p
    if not p.is_dir():
        raise ConversionError(f"--out '{p}' is a file, not a directory; choose another --out")
    entries = list(p.iterdir())
    if not entries:
        return p
    if not (p / "config.json").is_file():
        raise ConversionError(
            f"--out '{p}' is a non-empty directory without a model (no config.json); cadence "
            "replaces only a model directory: choose another --out"
        )
    if not force:
        raise ConversionError(f"'{p}' already holds a model; pass --force to replace it")
    return p


def load_gguf_tokenizer(info: GgufInfo, max_length: int | None = None):
    """The file's tokenizer, with the pre-tokenizer its model was trained with."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(info.path.parent, gguf_file=info.path.name)
    except (ValueError, KeyError, OSError) as e:
        raise ConversionError(
            f"cannot build the tokenizer of '{info.path}': {_first_line(e)}"
        ) from e
    if info.tokenizer_model == "gpt2" and info.tokenizer_pre in PRE_TOKENIZER_DIGITS:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if max_length:  # the model's context length, not transformers' "no limit" placeholder
        tok.model_max_length = max_length
    return tok


def load_gguf_model(info: GgufInfo):
    """The file's weights, dequantised to float32, in a model built from its config alone.

    transformers refuses here, before reading any weight, a file of an architecture it does not
    load from GGUF or one that is not a causal LM (a T5, say)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    try:  # dequantize=True: dense weights even where a packed-GGUF kernel is installed
        loaded = AutoModelForCausalLM.from_pretrained(
            info.path.parent,
            gguf_file=info.path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ConversionError(
            f"transformers cannot load '{info.path}' as a causal LM ('{info.architecture}' "
            f"architecture): {_first_line(e)}"
        ) from e
    # A GGUF quantization config makes save_pretrained refuse ("not serializable"), and a model
    # loaded through the GGUF path may keep that loader's modules or hooks (it depends on the
    # transformers version): build a plain model from the config without it, and move the weights.
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(
        type(loaded.config).from_dict(fields), dtype=torch.float32
    )
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(
            f"the weights of '{info.path}' do not fit {type(model).__name__}: missing "
            f"{result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]}"
        )
    return model.eval()


def _set_special_tokens(model, tokenizer, info: GgufInfo) -> tuple[int, ...]:
    """Make the end-of-turn token the tokenizer's EOS, set a pad token, and give the model's config
    and generation config the same ids. Returns the ids generation stops at."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    if info.end_of_turn_ids and eos not in info.end_of_turn_ids:
        # a chat model whose EOS ends the document, not the turn: a reply must stop at the turn
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(info.end_of_turn_ids[0])
    if tokenizer.eos_token_id is None:
        raise ConversionError(
            f"'{info.path}' names no EOS token (tokenizer.ggml.eos_token_id): generation would "
            "never stop"
        )
    if tokenizer.pad_token_id is None:  # padding only fills; the loss masks it out
        tokenizer.pad_token = tokenizer.eos_token
    stops = tuple(dict.fromkeys(i for i in (tokenizer.eos_token_id, eos, *info.end_of_turn_ids)))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stops[0] if len(stops) == 1 else list(stops),
        pad_token_id=tokenizer.pad_token_id,
    )
    return stops


def _save(model, tokenizer, tmp: Path) -> None:
    model.save_pretrained(tmp)  # safetensors, config.json, generation_config.json
    tokenizer.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    check_causal_lm(tmp)  # the directory reads back as the causal LM it should be


def _write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Run `write` on a temporary directory beside `out`, then swap it in; on any failure
    (Ctrl-C included) the temporary directory goes and `out` is as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        write(tmp)
        _usual_permissions(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _usual_permissions(d: Path) -> None:
    """The modes a plain mkdir and open would give under the umask: mkdtemp makes the directory
    0700 and safetensors writes its file 0600, which other users (a serving account) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    d.chmod(0o777 & ~umask)
    for f in d.iterdir():
        f.chmod(0o666 & ~umask)


def _swap_in(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an `out` already there (empty, or a model replaced with --force) is
    moved aside first and put back if the rename fails."""
    if not out.exists():
        os.replace(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.replace(out, old)  # onto the empty directory mkdtemp made
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old)


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message up to its first blank line, on one line and at most `limit`
    characters (transformers' can list every class it knows)."""
    text = str(e).strip().split("\n\n")[0].replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quiet_transformers() -> None:
    """No hub chatter or per-load progress bar: the conversion prints its own steps (transformers'
    bar over the GGUF tensors is a plain tqdm and stays, as progress on the longest step)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
