"""`cadence serve` apps on free loopback ports, over the tests' tiny model."""

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from cadence.engine import ContinuousEngine
from cadence.models import load_model, load_tokenizer
from cadence.serve import EngineLoop, Server, make_app

TOKEN = "sesame"


@contextlib.contextmanager
def serving(server: Server, token: str | None = TOKEN):
    """The app over `server` on a free loopback port: yields its base url (…/v1)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(server, token=token), log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline, "server did not start"
        assert thread.is_alive(), "server thread ended before it started"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        server.close()
        sock.close()


def tiny_server(
    model, tokenizer, loop: EngineLoop | None = None, max_num_seqs: int = 8, **limits
) -> Server:
    """A Server over the tiny model (1,024 positions, completions of at most 64 tokens); the
    loop restarts its engine after a failed step, as `build_server`'s does."""

    def fresh():
        return ContinuousEngine(model, tokenizer, max_num_seqs=max_num_seqs)

    loop = loop or EngineLoop(fresh(), renew=fresh)
    vocab = model.get_input_embeddings().num_embeddings
    return Server(loop, tokenizer, "test-model", 1024, 64, vocab_size=vocab, model=model, **limits)


@pytest.fixture(scope="module")
def tiny(model_dir):
    """(tokenizer, model): the tiny model, its messages as plain text, token for token."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    tokenizer.chat_template = None  # (test_serve.py tests the template path on its own)
    return tokenizer, model


@pytest.fixture
def start_server():
    """`serving(server, token)`: a context manager that yields the base url."""
    return serving


@pytest.fixture
def make_server(tiny):
    """`make_server(loop=None, tokenizer=None, max_num_seqs=8, **limits)`: a Server over the
    tiny model."""

    def make(loop=None, tokenizer=None, **kwargs):
        return tiny_server(tiny[1], tokenizer or tiny[0], loop, **kwargs)

    return make


@pytest.fixture(scope="module")
def served(tiny):
    """(base url, tokenizer, model) of a server with token 'sesame' on a free loopback port."""
    tokenizer, model = tiny
    with serving(tiny_server(model, tokenizer)) as url:
        yield url, tokenizer, model
