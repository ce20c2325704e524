"""A `cadence serve` app on a free loopback port, over the tests' tiny model."""

import socket
import threading
import time

import pytest
import uvicorn

from cadence.engine import ContinuousEngine
from cadence.models import load_model, load_tokenizer
from cadence.serve import EngineLoop, Server, make_app


@pytest.fixture(scope="module")
def served(model_dir):
    """(base url, tokenizer, model) of a server with token 'sesame' on a free loopback port."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    tokenizer.chat_template = None  # messages as plain text, token for token (test_serve.py)
    loop = EngineLoop(ContinuousEngine(model, tokenizer, max_num_seqs=8))
    server = Server(loop, tokenizer, "test-model", max_positions=1024, max_tokens=64)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(server, token="sesame"), log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", tokenizer, model
    http.should_exit = True
    thread.join(timeout=10)
    loop.close()
    sock.close()
