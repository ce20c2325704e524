"""Which request fields `cadence serve` honours, and the refusal of the rest.

A field the server does not honour is never dropped in silence: a request that sets one to
anything but its neutral value is refused (400) naming it, so a client that relies on it (a
JSON schema, a tool choice, a penalty) learns at once instead of training on what it did not ask
for. Fields that change nothing in the answer (`user`, `metadata`, ...) pass unread. No HTTP and
no engine here: app.py calls `refuse_unhonoured` while it prepares a request.

The design in full: docs/serve.md, `cadence/serve/fields.py`.
"""

from __future__ import annotations

from typing import Any

from cadence.serve.chat import BadRequest

# OpenAI's and vLLM's fields that leave the answer as it is: accepted, not read
HARMLESS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "parallel_tool_calls",  # every call the model writes is parsed back
        "return_token_ids",  # vLLM's: token ids are always returned
        "skip_special_tokens",  # vLLM's default, which the engines follow, is the only one
    }
)
# fields honoured at one value only: any other is refused
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "echo": (False,),
    "suffix": ("",),
}


def refuse_unhonoured(extra: dict[str, Any] | None, best_of_n: int | None = None) -> None:
    """BadRequest naming the first field of `extra` (the fields a request schema did not
    declare) that the server would not honour; `best_of_n`, where given, is the one `best_of`
    honoured (= n)."""
    for name, value in (extra or {}).items():
        if name in HARMLESS or value is None:
            continue
        if name == "best_of" and value == best_of_n:
            continue
        if name in NEUTRAL:
            if value in NEUTRAL[name]:
                continue
            raise BadRequest(
                f"{name} = {value!r} is not honoured by cadence serve (its engines sample "
                f"without it): leave it out or send {NEUTRAL[name][0]!r}"
            )
        raise BadRequest(f"{name}: not a field cadence serve honours; leave it out (docs/serve.md)")
