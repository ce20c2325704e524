"""`cadence serve`: an OpenAI-compatible chat-completions endpoint over a rollout engine, with
token ids and log-probs in every response (app.py routes, chat.py schema, engine_loop.py the
engine's thread)."""

from cadence.serve.app import Server, build_server, check_binding, is_loopback, make_app, run
from cadence.serve.chat import ChatRequest, render, response
from cadence.serve.engine_loop import EngineLoop

__all__ = [
    "ChatRequest",
    "EngineLoop",
    "Server",
    "build_server",
    "check_binding",
    "is_loopback",
    "make_app",
    "render",
    "response",
    "run",
]
