"""Where a model says its responses end: the ids its own generation settings stop at.

A chat model's end of turn is often not its tokenizer's EOS (Gemma's `<end_of_turn>`, Llama 3's
`<|eot_id|>`): the model directory's `generation_config.json` lists the ids generation stops at
(`eos_token_id`, an int or a list), and `config.json` may name one. `stop_token_ids` is the union
with the tokenizer's EOS. The files are read as JSON, as written, with no class defaults filled
in; a LoRA adapter's directory (a run's final/) speaks for its base model. Nothing here loads a
model or decides anything else about sampling.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from cadence.models.io import ADAPTER_CONFIG


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The `eos_token_id`s of the model in `path`: its generation config's, else its config's
    (none where neither names one, or `path` is no model directory)."""
    p = Path(path)
    if not (p / "config.json").is_file() and (p / ADAPTER_CONFIG).is_file():
        base = json.loads((p / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        return generation_eos_ids(base) if base else ()
    for name in ("generation_config.json", "config.json"):
        f = p / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def stop_token_ids(tokenizer, path: str | Path, extra: Iterable[int] = ()) -> tuple[int, ...]:
    """Where generation stops: the tokenizer's EOS, the model's `generation_eos_ids`, then
    `extra`; each id once, in that order."""
    ids = (tokenizer.eos_token_id, *generation_eos_ids(path), *extra)
    return tuple(dict.fromkeys(int(i) for i in ids))
