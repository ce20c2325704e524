"""The engine factory: the one place that maps an engine's name to its class.

'continuous' (cadence's slot engine; falls back to 'static', with a warning, where it does not
reproduce the model), 'static' (batches that end with their slowest sequence) and 'vllm' (its own
copy of the model, loaded from the model directory). Everything else asks an engine what it is
through the Engine Protocol; nothing outside this module tests an engine's class.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from cadence.engine.base import Engine
from cadence.engine.continuous import ContinuousEngine, check_continuous
from cadence.engine.hf import HFEngine

if TYPE_CHECKING:
    from cadence.engine.vllm import VLLMOptions

KINDS = ("continuous", "static", "vllm")


def make_engine(
    kind: str,
    model,
    tokenizer,
    max_num_seqs: int,
    *,
    model_path: str | None = None,
    dtype: str = "float32",
    vllm: VLLMOptions | None = None,
) -> Engine:
    """'continuous' (falls back to 'static', with a warning, where the check fails), 'static',
    or 'vllm' (its own copy of the model in `model_path`, as `dtype`; `model` is not used)."""
    if kind == "vllm":
        from cadence.engine.vllm import VLLMEngine

        if model_path is None:
            raise ValueError("the 'vllm' engine loads its own model: pass model_path")
        return VLLMEngine(
            model_path, tokenizer, max_num_seqs=max_num_seqs, dtype=dtype, options=vllm
        )
    if kind == "continuous":
        reason = check_continuous(model, tokenizer)
        if reason is None:
            return ContinuousEngine(model, tokenizer, max_num_seqs=max_num_seqs)
        warnings.warn(
            f"continuous batching does not reproduce this model ({reason}); "
            "using static batches (rollout.engine = 'static')",
            stacklevel=2,
        )
    elif kind != "static":
        raise ValueError(f"unknown engine {kind!r}; use {', '.join(repr(k) for k in KINDS)}")
    return HFEngine(model, tokenizer, max_num_seqs=max_num_seqs)
