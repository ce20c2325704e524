"""Inference engines: the Protocol, Hugging Face implementations (continuous batching and static
batches), vLLM (`cadence.engine.vllm`, imported on use: vllm is optional), and a scripted fake."""

from cadence.engine.base import (
    BatchStepper,
    Engine,
    Request,
    SamplingParams,
    StreamingEngine,
    as_streaming,
    derive_seed,
    derive_turn_seed,
    sample_tokens,
    step_uniforms,
)
from cadence.engine.continuous import (
    ContinuousEngine,
    UnsupportedModel,
    check_continuous,
    make_engine,
)
from cadence.engine.fake import ScriptedEngine
from cadence.engine.hf import HFEngine

__all__ = [
    "BatchStepper",
    "ContinuousEngine",
    "Engine",
    "HFEngine",
    "Request",
    "SamplingParams",
    "ScriptedEngine",
    "StreamingEngine",
    "UnsupportedModel",
    "as_streaming",
    "check_continuous",
    "derive_seed",
    "derive_turn_seed",
    "make_engine",
    "sample_tokens",
    "step_uniforms",
]
