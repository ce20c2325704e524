"""Token in, token out: vLLM's `POST /inference/v1/generate`, the route verifiers' training
client samples through.

Read on: docs/serve.md.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from cadence.serve.chat import MAX_STOPS, BadRequest, Sampling
from cadence.serve.fields import NEUTRAL
from cadence.types import Completion

# vLLM's sampling settings the engines do not apply, accepted at their neutral value only
UNAPPLIED = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class GenerateSampling(Sampling):
    """vLLM's `sampling_params`, the fields a cadence engine honours; others pass unread."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # cadence's derived seeds are 63-bit
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_STOPS)

    @model_validator(mode="after")
    def _seeds_fit(self) -> GenerateSampling:
        if self.seed is not None and self.seed + self.n > 2**63:
            raise ValueError("seed + n must be at most 2**63 (choice j is seeded by seed + j)")
        return self

    def check_supported(self) -> None:
        """Refuse a sampling setting the engine would silently not apply."""
        for name in UNAPPLIED:
            neutral, value = NEUTRAL[name], (self.model_extra or {}).get(name)
            if value is not None and value not in neutral:
                raise BadRequest(
                    f"sampling_params.{name} = {value!r} is not supported by cadence's engines; "
                    f"leave it out or set it to {neutral[0]!r}"
                )


class GenerateRequest(BaseModel):
    """What /inference/v1/generate accepts (vLLM's body); multimodal fields are refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    token_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    features: Any = None
    content_parts: Any = None

    def check_supported(self) -> None:
        if self.features is not None or self.content_parts is not None:
            raise BadRequest("features / content_parts: cadence serves text models only")
        self.sampling_params.check_supported()

    def seeds(self, random_base: int) -> list[int]:
        s = self.sampling_params
        base = s.seed if s.seed is not None else random_base
        return [base + j for j in range(s.n)]


def generate_response(prompt_ids: list[int], completions: list[Completion]) -> dict[str, Any]:
    """vLLM's generate answer: per choice the sampled ids, their log-probs and why it ended."""
    choices = [
        {
            "index": j,
            "token_ids": c.token_ids,
            "logprobs": {
                "content": [
                    {"token": f"token_id:{t}", "logprob": lp}
                    for t, lp in zip(c.token_ids, c.logprobs, strict=True)
                ]
            },
            "finish_reason": "length" if c.finish_reason == "length" else "stop",
        }
        for j, c in enumerate(completions)
    ]
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "choices": choices,
        "prompt_token_ids": prompt_ids,
    }
