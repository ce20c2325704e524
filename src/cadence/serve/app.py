"""`cadence serve`: an OpenAI-compatible HTTP endpoint over a rollout engine (FastAPI + uvicorn):
chat completions (tools, top log-probs, streaming), text completions, and vLLM's token route.

One bad request gets an answer of its own and changes nothing for the others: a body over
`max_body_bytes` or a field out of range is refused (400, saying which and why) before anything
reaches the engine, a request the engine fails on fails alone (500, engine_loop.py finds it), and
only an engine that serves no more turns /health and every request to 503. Tokenising, chat
templates and decoding run on a thread of their own, never on the event loop, so /health and the
other requests are answered while a long prompt is rendered.

Read on: docs/serve.md.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from cadence.engine import Request, SamplingParams
from cadence.serve.chat import (
    BadRequest,
    ChatRequest,
    Limits,
    TopLogprobs,
    check_prompt,
    check_text,
    render,
    response,
)
from cadence.serve.completions import CompletionRequest, completion_response
from cadence.serve.engine_loop import EngineBroken, EngineLoop, RequestFailed
from cadence.serve.fields import refuse_unhonoured
from cadence.serve.generate import GenerateRequest, generate_response
from cadence.serve.logprobs import top_logprobs
from cadence.serve.stream import DONE, chat_chunks, completion_chunks, event
from cadence.types import Completion

MAX_TOKENS = 256  # a request's default and the server's ceiling, unless `cadence serve` sets it
MAX_BODY_BYTES = 4 << 20  # a prompt at 128k positions is under 1 MiB as ids and as text

T = TypeVar("T")


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


@dataclass(frozen=True)
class Job:
    """A checked request, ready for the engine: the prompt, seeds and token limit, and params."""

    request: Request
    params: SamplingParams


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
        vocab_size: int,
        max_body_bytes: int = MAX_BODY_BYTES,
        stop_token_ids: tuple[int, ...] = (),
        model=None,
    ):
        """A response ends at `stop_token_ids` (the tokenizer's EOS where none are given);
        `model`, the engine's, scores `top_logprobs` (refused without it)."""
        self.loop, self.tokenizer, self.name, self.model = loop, tokenizer, name, model
        self.max_positions, self.max_tokens = max_positions, max_tokens
        self.limits = Limits(vocab_size, max_positions, max_tokens)
        self.max_body_bytes = max_body_bytes
        self.params = SamplingParams(
            max_new_tokens=max_tokens, stop_token_ids=stop_token_ids or (tokenizer.eos_token_id,)
        )
        # one thread: the tokenizer is used from one place at a time, and never the event loop
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="cadence-serve-tokenizer")

    async def chat(self, request: ChatRequest) -> dict[str, Any] | list[str]:
        """The answer, or its server-sent events when the request streams."""
        return await self.serve(request, self.prepare, self.answer_chat)

    async def serve(self, request, prepare: Callable, answer: Callable):
        """`prepare(request)` (a Job), the engine's completions of it, then `answer(request, job,
        completions)`: checking and answering on the tokenizer's thread, never the event loop."""
        job = await self.off_loop(prepare, request)
        completions = await asyncio.wrap_future(self.loop.submit(job.request, job.params))
        return await self.off_loop(answer, request, job, completions)

    def answer_chat(self, request: ChatRequest, job: Job, completions: list[Completion]):
        k = request.top_logprobs
        return self.answer(request, job, completions, k, response, chat_chunks)

    def answer(self, request, job: Job, completions: list[Completion], k, build, chunks):
        """`build(...)`, the answer object (with `k` alternatives per token), or where the
        request streams its events from `chunks(...)`."""
        prompt = job.request.prompt_ids
        tops = self.alternatives(prompt, completions, k, job.params)
        full = build(request, self.name, prompt, completions, self.tokenizer, tops)
        if not request.stream:
            return full
        return [*map(event, chunks(request, full, completions, self.tokenizer)), DONE]

    def prepare(self, request: ChatRequest) -> Job:
        """The prompt's tokens, checked against the model (BadRequest if it cannot take them)."""
        refuse_unhonoured(request.model_extra)
        request.check_tool_choice()
        self.check_alternatives(request.top_logprobs, "top_logprobs")
        return self.job(request, render(request, self.tokenizer), request.limit)

    def job(self, request, prompt: list[int], limit: int | None, field="prompt_token_ids") -> Job:
        """The engine's work for `prompt`: checked against the model, at most `limit` new tokens
        (the server's ceiling), sampled as `request` (a chat or completions request) says."""
        limit = min(limit or self.max_tokens, self.max_tokens)
        check_prompt(prompt, limit, self.limits, field=field)
        params = replace(
            self.params,
            temperature=request.temperature,
            top_p=request.top_p,
            stop=tuple(request.stops),
        )
        return Job(Request(prompt, request.seeds(), max_new_tokens=limit), params)

    async def complete(self, request: CompletionRequest) -> dict[str, Any] | list[str]:
        """/v1/completions: the answer, or its server-sent events when the request streams."""
        return await self.serve(request, self.prepare_completion, self.answer_completion)

    def prepare_completion(self, request: CompletionRequest) -> Job:
        refuse_unhonoured(request.model_extra, best_of_n=request.n)
        self.check_alternatives(request.logprobs, "logprobs")
        return self.job(request, request.prompt_ids(self.encode), request.max_tokens, "prompt")

    def answer_completion(
        self, request: CompletionRequest, job: Job, completions: list[Completion]
    ):
        k = request.logprobs
        return self.answer(request, job, completions, k, completion_response, completion_chunks)

    def check_alternatives(self, k: int | None, field: str) -> None:
        if k and self.model is None:
            raise BadRequest(f"{field} = {k}: this server has no model to score alternatives")

    def alternatives(
        self, prompt: list[int], completions: list[Completion], k: int | None, params
    ) -> list[TopLogprobs] | None:
        """Per choice, per token, the `k` likeliest tokens (None when none are asked)."""
        if not k:
            return None
        return [
            top_logprobs(self.model, prompt, c.token_ids, k, params.temperature)
            for c in completions
        ]

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        job = await self.off_loop(self.prepare_generate, request)
        completions = await asyncio.wrap_future(self.loop.submit(job.request, job.params))
        return generate_response(job.request.prompt_ids, completions)

    def prepare_generate(self, request: GenerateRequest) -> Job:
        """The prompt exactly as sent, checked as a chat prompt is; stop ids besides the
        server's own (BadRequest for what the model cannot take or the engine cannot do)."""
        request.check_supported()
        s = request.sampling_params
        limit = min(s.max_tokens or self.max_tokens, self.max_tokens)
        check_prompt(request.token_ids, limit, self.limits, field="token_ids")
        for token in s.stop_token_ids:
            if not 0 <= token < self.limits.vocab_size:
                raise BadRequest(f"sampling_params.stop_token_ids: {token} is not a token id")
        params = replace(
            self.params,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=tuple(s.stops),
            stop_token_ids=tuple(dict.fromkeys((*self.params.stop_token_ids, *s.stop_token_ids))),
        )
        seeds = request.seeds(secrets.randbits(62))
        return Job(Request(list(request.token_ids), seeds, max_new_tokens=limit), params)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer's thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def close(self) -> None:
        self.loop.close()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is refused (400) before any of it is parsed, by
    its Content-Length or, sent in chunks, once the chunks pass the limit; a body within it is
    read whole here and handed on."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(int(declared), scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(size, scope, receive, send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # after the body: a disconnect, when it comes
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, scope, receive, send) -> None:
        from fastapi.responses import JSONResponse

        why = f"the request body is {size} bytes or more, over the server's limit of {self.limit}"
        await JSONResponse(_error(why, "invalid_request_error"), status_code=400)(
            scope, receive, send
        )


def make_app(server: Server, token: str | None = None):
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="cadence serve")
    app.add_middleware(BodyLimit, limit=server.max_body_bytes)
    expected = f"Bearer {token}".encode() if token else b""

    @app.middleware("http")
    async def authorize(http: HttpRequest, call_next):
        # as bytes: a header may hold any byte (Starlette reads it as latin-1), and
        # compare_digest takes str of ASCII only
        sent = http.headers.get("authorization", "").encode("latin-1")
        if token and not hmac.compare_digest(sent, expected):
            return JSONResponse(_error("missing or wrong bearer token", "auth"), status_code=401)
        return await call_next(http)

    def answer(status: int, kind: str):
        async def handler(http: HttpRequest, e: Exception):
            return JSONResponse(_error(str(e), kind), status_code=status)

        return handler

    app.add_exception_handler(BadRequest, answer(400, "invalid_request_error"))
    app.add_exception_handler(RequestFailed, answer(500, "server_error"))
    app.add_exception_handler(EngineBroken, answer(503, "server_error"))

    @app.exception_handler(RequestValidationError)
    async def bad_field(http: HttpRequest, e: RequestValidationError):
        where = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in e.errors()
        )
        return JSONResponse(_error(where, "invalid_request_error"), status_code=400)

    def reply(body: dict[str, Any] | list[str]):
        # as it is: FastAPI's own encoder would walk every log-prob on the event loop (2 ms for
        # n = 4 x 16 tokens, against 0.3 ms for json.dumps)
        if isinstance(body, list):
            return StreamingResponse(iter(body), media_type="text/event-stream")
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest):
        return reply(await server.chat(request))

    @app.post("/v1/completions")
    async def complete(request: CompletionRequest):
        return reply(await server.complete(request))

    @app.post("/inference/v1/generate")
    async def generate(request: GenerateRequest):
        return JSONResponse(await server.generate(request))

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise BadRequest("tokenize: send {'prompt': TEXT}")
        tokens = await server.off_loop(server.encode, check_text(text, "prompt"))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_positions}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": server.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "cadence",
            "max_model_len": server.max_positions,
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health():
        why = server.loop.broken
        if why is not None:  # a supervisor restarts on this
            return JSONResponse({"status": "broken", "reason": why}, status_code=503)
        return {"status": "ok"}

    return app


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def build_server(model_dir: str, max_num_seqs: int = 64, max_tokens: int = MAX_TOKENS) -> Server:
    """Load a Hugging Face causal-LM directory behind a continuous-batching engine."""
    from pathlib import Path

    from cadence.engine import StreamingEngine, make_engine, open_engine
    from cadence.models import load_tokenizer, max_positions, stop_token_ids

    tokenizer = load_tokenizer(model_dir)
    engine, weights = open_engine("continuous", str(model_dir), tokenizer, max_num_seqs)
    model = weights.model.eval()
    # after a step that raised, the loop asks the factory for a fresh engine of the kind it
    # chose (continuous, or static where continuous batching does not reproduce the model)
    kind = "continuous" if isinstance(engine, StreamingEngine) else "static"
    renew = partial(make_engine, kind, model, tokenizer, max_num_seqs)
    return Server(
        EngineLoop(engine, renew),
        tokenizer,
        Path(model_dir).name,
        max_positions(model) or 4096,
        max_tokens,
        vocab_size=model.get_input_embeddings().num_embeddings,
        stop_token_ids=stop_token_ids(tokenizer, model_dir),  # a chat model's end of turn too
        model=model,
    )


def run(server: Server, host: str, port: int, token: str | None) -> None:
    """Serve until interrupted."""
    import uvicorn

    check_binding(host, token)
    try:
        uvicorn.run(make_app(server, token), host=host, port=port, log_level="info")
    finally:
        server.close()
