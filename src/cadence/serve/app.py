"""`cadence serve`: an OpenAI-compatible HTTP endpoint over a rollout engine (FastAPI + uvicorn).

Routes: POST /v1/chat/completions (chat.py has the schema), POST /tokenize ({"prompt": text} ->
{"tokens": [...], "count": n}, as vLLM's), GET /v1/models, GET /health. Bound to 127.0.0.1 by
default, where no token is needed; bound anywhere else it needs a token, and with a token every
request must carry `Authorization: Bearer TOKEN`. Nothing else is listened to or fetched.
FastAPI and uvicorn are imported here only (the `serve` extra).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from dataclasses import replace
from typing import Any

from cadence.engine import Request, SamplingParams
from cadence.serve.chat import ChatRequest, render, response
from cadence.serve.engine_loop import EngineLoop

MAX_TOKENS = 256  # a request's default and the server's ceiling, unless `cadence serve` sets it


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_binding(host: str, token: str | None) -> None:
    """Refuse to listen beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"serving on {host!r} (not loopback) needs a token: pass --token or set "
            "CADENCE_SERVE_TOKEN, and send 'Authorization: Bearer TOKEN'; or bind 127.0.0.1"
        )


class Server:
    """The engine, tokenizer and limits behind the routes (no HTTP here: `make_app` adds it)."""

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer,
        name: str,
        max_positions: int,
        max_tokens: int,
        *,
        stop_token_ids: tuple[int, ...] = (),
    ):
        """A response ends at `stop_token_ids` (the tokenizer's EOS where none are given)."""
        self.loop, self.tokenizer, self.name = loop, tokenizer, name
        self.max_positions, self.max_tokens = max_positions, max_tokens
        self.params = SamplingParams(
            max_new_tokens=max_tokens, stop_token_ids=stop_token_ids or (tokenizer.eos_token_id,)
        )

    async def chat(self, request: ChatRequest) -> dict[str, Any]:
        prompt = render(request, self.tokenizer)
        limit = min(request.limit or self.max_tokens, self.max_tokens)
        if not prompt or len(prompt) + limit > self.max_positions:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {limit} must be 1 to "
                f"{self.max_positions} tokens (the model's positions)"
            )
        params = replace(
            self.params,
            temperature=request.temperature,
            top_p=request.top_p,
            stop=tuple(request.stops),
        )
        future = self.loop.submit(Request(prompt, request.seeds(), max_new_tokens=limit), params)
        completions = await asyncio.wrap_future(future)
        return response(request, self.name, prompt, completions, self.tokenizer)


def make_app(server: Server, token: str | None = None):
    from fastapi import FastAPI, HTTPException
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="cadence serve")

    @app.middleware("http")
    async def authorize(http: HttpRequest, call_next):
        if token and not hmac.compare_digest(
            http.headers.get("authorization", ""), f"Bearer {token}"
        ):
            return JSONResponse(_error("missing or wrong bearer token", "auth"), status_code=401)
        return await call_next(http)

    @app.exception_handler(ValueError)
    async def bad_request(http: HttpRequest, e: ValueError):
        return JSONResponse(_error(str(e), "invalid_request_error"), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def bad_field(http: HttpRequest, e: RequestValidationError):
        where = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in e.errors()
        )
        return JSONResponse(_error(where, "invalid_request_error"), status_code=400)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest) -> dict[str, Any]:
        try:
            return await server.chat(request)
        except RuntimeError as e:
            raise HTTPException(status_code=500, detail=str(e)) from None

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ValueError("tokenize: send {'prompt': TEXT}")
        tokens = server.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_positions}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": server.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "cadence",
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def build_server(model_dir: str, max_num_seqs: int = 64, max_tokens: int = MAX_TOKENS) -> Server:
    """Load a Hugging Face causal-LM directory behind a continuous-batching engine."""
    from pathlib import Path

    from cadence.engine import open_engine
    from cadence.models import load_tokenizer, max_positions, stop_token_ids

    tokenizer = load_tokenizer(model_dir)
    engine, weights = open_engine("continuous", str(model_dir), tokenizer, max_num_seqs)
    positions = max_positions(weights.model) or 4096
    stops = stop_token_ids(tokenizer, model_dir)  # a chat model's end of turn, not EOS alone
    name = Path(model_dir).name
    return Server(EngineLoop(engine), tokenizer, name, positions, max_tokens, stop_token_ids=stops)


def run(server: Server, host: str, port: int, token: str | None) -> None:
    """Serve until interrupted."""
    import uvicorn

    check_binding(host, token)
    uvicorn.run(make_app(server, token), host=host, port=port, log_level="info")
