"""Inference engines: the Protocol, a Hugging Face implementation, and a scripted fake."""

from cadence.engine.base import (
    Engine,
    Request,
    SamplingParams,
    derive_seed,
    sample_tokens,
    step_uniforms,
)
from cadence.engine.fake import ScriptedEngine
from cadence.engine.hf import HFEngine

__all__ = [
    "Engine",
    "HFEngine",
    "Request",
    "SamplingParams",
    "ScriptedEngine",
    "derive_seed",
    "sample_tokens",
    "step_uniforms",
]
