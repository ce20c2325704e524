"""`[model]`: the policy's directory, dtype, device and LoRA adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cadence.config.base import Section


class LoraSettings(Section):
    r: int = Field(16, ge=1)
    """Rank of each adapter's update B @ A."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the update is alpha / r * BA."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names of the linear layers that get an adapter (module name suffixes, as peft matches them);
    one that matches no module of the model is an error."""
    save_merged: bool = False
    """Also write final/merged/: a whole model with the adapter merged in."""


class ModelConfig(Section):
    path: str = "runs/sft"
    """Local Hugging Face causal-LM directory to train."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The compute dtype: the learner's passes and every engine's weights. With bfloat16 the
    optimizer keeps float32 master weights and float32 state (learner.master_dtype), as FSDP2's
    mixed precision does; a LoRA adapter stays float32 under a bf16 base."""
    device: str = "cpu"
    """Torch device for learner and colocated engine."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (peft) instead of every weight: {r, alpha, dropout, target_modules}. The
    reference is the same model with the adapter disabled; vLLM engines receive the adapter alone
    (colocated or in local workers without partial rollouts: its LoRA requests), other engines
    merged weights; final/ holds the adapter (save_merged: and the model)."""
