"""`[rollout]`: sampling and the engine that generates, with `[rollout.vllm]`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cadence.choices import ENGINE_NAMES, engine_kind
from cadence.config.base import Section

# vLLM arguments cadence sets itself (engine/vllm.py): not for rollout.vllm.engine_args
VLLM_RESERVED_ARGS = ("model", "tokenizer", "seed", "logprobs_mode", "max_num_seqs", "max_logprobs")


class VLLMConfig(Section):
    """`[rollout.vllm]`: each key is the vLLM engine argument of the same name."""

    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of the GPU's memory vLLM takes (weights, activations, KV cache); lower it when the
    learner shares the GPU (placement 'colocated'). On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE
    GiB instead (cadence's default: 1)."""
    enforce_eager: bool = False
    """Run the model eagerly: no torch.compile, no CUDA graphs (a faster start, slower decoding on a
    GPU)."""
    max_model_len: int = Field(0, ge=0)
    """Longest prompt + response vLLM plans for (0: the model's own)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations in vLLM (auto: model.dtype)."""
    enable_prefix_caching: bool = True
    """Reuse the keys and values of whole blocks of a prompt across its G samples (emptied at each
    weight update)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine's model is split across (vLLM's own workers)."""
    sleep_mode: bool = True
    """Colocated on a GPU: vLLM sleeps while the learner trains (level 1: its weights moved to host
    memory, its KV cache freed) and wakes before the next weight sync, so the learner has the GPU's
    memory to itself between generations; false keeps vLLM resident. Nothing where vLLM has no
    sleep mode (CPU) or with separate workers (their GPUs are their own)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other vLLM engine argument by its name (e.g. block_size, kv_cache_dtype, swap_space),
    passed as given; checked when the engine starts."""

    @model_validator(mode="after")
    def _no_owned_args(self) -> VLLMConfig:
        for key in self.engine_args:
            if key in VLLM_RESERVED_ARGS:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} is set by cadence (model path, per-sample "
                    "seeds, behaviour log-probs, rollout.max_num_seqs): leave it out"
                )
            if key in VLLMConfig.model_fields:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} has a key of its own: set rollout.vllm.{key}"
                )
        return self


class RolloutConfig(Section):
    group_size: int = Field(8, ge=1)
    """Responses sampled per prompt (G)."""
    max_new_tokens: int = Field(48, ge=1)
    """Longest response, in tokens."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (EOS always)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids a response stops at (kept in it). Always stopped at: the tokenizer's EOS and
    the model's generation_config.json eos_token_id (an int or a list: a chat model's end-of-turn
    token)."""
    max_prompt_tokens: int = Field(0, ge=0)
    """Longest prompt, in tokens; see on_long_prompt. 0: what the model takes (its
    max_position_embeddings, or rollout.vllm.max_model_len where that is lower) minus
    max_new_tokens, or with env.kind = 'tool' minus env.max_total_tokens (a whole episode). A value
    over that is refused: prompt and response always fit."""
    on_long_prompt: Literal["skip", "truncate"] = "skip"
    """A prompt over max_prompt_tokens: skip it (the next example takes its place) or keep its last
    max_prompt_tokens tokens; counted as prompts_skipped / prompts_truncated in metrics.jsonl."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences an engine decodes at once (its slots)."""
    engine: Literal[ENGINE_NAMES] = "continuous"
    """continuous: a finished sequence's slot is refilled at once and each group leaves as soon as
    it is complete; static: batches that end with their slowest sequence; vllm: vLLM's engine
    (paged attention, CUDA graphs, prefix cache, tensor parallelism), set up by [rollout.vllm];
    needs the 'vllm' extra (docs/engines.md)."""
    vllm: VLLMConfig = Field(default_factory=lambda: VLLMConfig())
    """engine 'vllm': its settings."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if "" in stop:
            raise ValueError("an empty stop string would end every response after one token")
        return stop

    @model_validator(mode="after")
    def _vllm_keys_for_vllm(self) -> RolloutConfig:
        if engine_kind(self.engine).options != "vllm" and self.vllm != VLLMConfig():
            raise ValueError(
                f"rollout.vllm applies to rollout.engine = 'vllm' only, not '{self.engine}': "
                "set the engine or leave [rollout.vllm] out"
            )
        return self
