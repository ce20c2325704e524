"""The engine factory: the one place that maps an engine's name to its class.

'continuous' (cadence's slot engine; falls back to 'static', with a warning, where
`check_continuous` finds it does not reproduce the model), 'static' (batches that end with their
slowest sequence) and 'vllm' (its own copy of the model, loaded from the model directory, set up
by its options). What each engine brings is its row in `cadence.choices.ENGINES`; `open_engine`
also answers what new weights load into (`EngineWeights`): the model the engine decodes with, or
a skeleton of the engine's own copy. Everything else asks an engine what it is through the Engine
Protocol (`owns_weights`) or its kind's traits; nothing outside this module tests its class.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from cadence.choices import ENGINE_NAMES, engine_kind
from cadence.engine.base import Engine, Request, SamplingParams
from cadence.engine.continuous import ContinuousEngine, UnsupportedModel
from cadence.engine.hf import HFEngine
from cadence.engine.weights import EngineWeights

if TYPE_CHECKING:
    from cadence.engine.vllm import VLLMOptions

    EngineOptions = VLLMOptions  # the options of each engine that takes some (choices.ENGINES)

KINDS = ENGINE_NAMES


def make_engine(
    kind: str,
    model,
    tokenizer,
    max_num_seqs: int,
    *,
    model_path: str | None = None,
    dtype: str = "float32",
    options: EngineOptions | None = None,
) -> Engine:
    """'continuous' (falls back to 'static', with a warning, where the check fails), 'static',
    or 'vllm' (its own copy of the model in `model_path`, as `dtype`; `model` is not used).
    `options`: the engine's own settings, for an engine that takes some (None: its defaults)."""
    traits = engine_kind(kind)
    if options is not None and not traits.options:
        raise ValueError(f"engine {kind!r} takes no options; got {type(options).__name__}")
    if traits.own_copy:
        from cadence.engine.vllm import VLLMEngine

        if model_path is None:
            raise ValueError(f"the {kind!r} engine loads its own model: pass model_path")
        return VLLMEngine(
            model_path, tokenizer, max_num_seqs=max_num_seqs, dtype=dtype, options=options
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
    return HFEngine(model, tokenizer, max_num_seqs=max_num_seqs)


def keeps_own_copy(kind: str) -> bool:
    """Whether engine `kind` loads its own copy of the model (so none is loaded for it): what its
    instances answer as `owns_weights`, known before one is built."""
    return engine_kind(kind).own_copy


def open_engine(
    kind: str,
    model_path: str,
    tokenizer,
    max_num_seqs: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    options: EngineOptions | None = None,
    model=None,
) -> tuple[Engine, EngineWeights]:
    """Engine `kind` over the model in `model_path`, and its weights as new ones load into them.

    An engine that decodes with a model object decodes with `model` (loaded from `model_path` as
    `dtype` on `device` when None); one that keeps its own copy loads it itself (`model` unused)
    and a skeleton describes its weights: the model is never loaded twice.
    """
    from cadence.models import DTYPES, load_model, load_skeleton

    if keeps_own_copy(kind):
        engine = make_engine(
            kind, None, tokenizer, max_num_seqs, model_path=model_path, dtype=dtype, options=options
        )
        return engine, EngineWeights(engine, load_skeleton(model_path, DTYPES[dtype]))
    if model is None:
        model = load_model(model_path, dtype=DTYPES[dtype], device=device)
    engine = make_engine(kind, model, tokenizer, max_num_seqs)
    return engine, EngineWeights(engine, model)


def check_continuous(model, tokenizer) -> str | None:
    """Why continuous batching cannot serve this model (None: it can).

    Decodes two short prompts with sampling both ways, the static engine being the reference, and
    compares tokens and log-probs. Catches models whose cache or attention this engine does not
    reproduce (sliding windows, custom caches) before they generate anything wrong.
    """
    ids = tokenizer("1 + 2 = 3", add_special_tokens=False)["input_ids"] or [0]
    requests = [Request(ids, [1, 2]), Request(ids[:1] * 3, [3])]
    params = SamplingParams(max_new_tokens=4)
    try:
        got = ContinuousEngine(model, tokenizer, max_num_seqs=2).generate(requests, params)
    except (UnsupportedModel, RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    want = HFEngine(model, tokenizer).generate(requests, params)
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if a.token_ids != b.token_ids:
                return f"sampled {a.token_ids}, the reference engine {b.token_ids}"
            diff = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0)
            if diff > tol:
                return f"log-probs differ from the reference engine by {diff:.1e}"
    return None
