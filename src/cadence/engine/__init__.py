"""Inference engines: the Protocol, Hugging Face implementations (continuous batching and static
batches), vLLM (`cadence.engine.vllm`, imported on use: vllm is optional), a scripted fake, and
the factory that picks one by name (`engine/factory.py`)."""

from cadence.engine.base import (
    BatchStepper,
    Engine,
    InFlightWeights,
    Releases,
    Request,
    RequestRefused,
    SamplingParams,
    Sleeps,
    StreamingEngine,
    TakesAdapters,
    Tensors,
    WeightOwner,
    as_streaming,
    derive_seed,
    derive_turn_seed,
    generate_by_steps,
    release_cached_memory,
    sample_tokens,
    step_uniforms,
)
from cadence.engine.continuous import ContinuousEngine, UnsupportedModel
from cadence.engine.factory import check_continuous, keeps_own_copy, make_engine, open_engine
from cadence.engine.fake import ScriptedEngine
from cadence.engine.hf import HFEngine
from cadence.engine.weights import EngineWeights, load_into

__all__ = [
    "BatchStepper",
    "ContinuousEngine",
    "Engine",
    "EngineWeights",
    "HFEngine",
    "InFlightWeights",
    "Releases",
    "Request",
    "RequestRefused",
    "SamplingParams",
    "ScriptedEngine",
    "Sleeps",
    "StreamingEngine",
    "TakesAdapters",
    "Tensors",
    "UnsupportedModel",
    "WeightOwner",
    "as_streaming",
    "check_continuous",
    "derive_seed",
    "derive_turn_seed",
    "generate_by_steps",
    "keeps_own_copy",
    "load_into",
    "make_engine",
    "open_engine",
    "release_cached_memory",
    "sample_tokens",
    "step_uniforms",
]
