"""The engine loop a rollout worker steps for a verifiers environment: requests wait until the
worker's step admits them, one round of equal sampling params at a time, each seed mapped to its
turn's; closing fails whatever still waits."""

import threading

import pytest

from cadence.engine import Request, SamplingParams, ScriptedEngine, as_streaming
from cadence.rollout.verifiers import StepLoop
from cadence.serve.engine_loop import EngineBroken, RequestFailed

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=4, temperature=1.0)


def _engine():
    return as_streaming(ScriptedEngine(lambda prompt, seed: [seed % 1000, 1]))


def test_requests_run_in_rounds_of_equal_params_with_their_turn_seeds():
    wake = threading.Event()
    loop = StepLoop(wake, turn_seed=lambda seed: seed + 100)
    engine = _engine()
    a = loop.submit(Request([1, 2], [5]), GREEDY)
    b = loop.submit(Request([3], [6]), SAMPLED)
    c = loop.submit(Request([4], [7]), GREEDY)
    assert wake.is_set() and loop.pending and not a.done()  # nothing runs until the owner steps
    loop.step(engine)
    assert a.result(timeout=0)[0].token_ids == [105, 1]
    assert c.result(timeout=0)[0].token_ids == [107, 1]
    assert not b.done()  # other params: the next round
    loop.step(engine)
    assert b.result(timeout=0)[0].token_ids == [106, 1] and not loop.pending


def test_a_request_the_engine_refuses_fails_alone_and_closing_fails_the_rest():
    loop = StepLoop(threading.Event(), turn_seed=lambda seed: seed)
    engine = _engine()

    def refuse(key, request, params):
        if request.prompt_ids == [9]:
            raise ValueError("too long")
        return add(key, request, params)

    add, engine.add = engine.add, refuse
    bad = loop.submit(Request([9], [1]), GREEDY)
    good = loop.submit(Request([8], [2]), GREEDY)
    loop.step(engine)
    with pytest.raises(RequestFailed, match="too long"):
        bad.result(timeout=0)
    assert good.result(timeout=0)[0].token_ids == [2, 1]
    waiting = loop.submit(Request([8], [3]), GREEDY)
    loop.close()
    with pytest.raises(EngineBroken):
        waiting.result(timeout=0)
    with pytest.raises(EngineBroken):
        loop.submit(Request([8], [4]), GREEDY).result(timeout=0)


def test_a_request_cancelled_while_waiting_never_reaches_the_engine():
    loop = StepLoop(threading.Event(), turn_seed=lambda seed: seed)
    engine = _engine()
    added = []
    add = engine.add
    engine.add = lambda key, request, params: (
        added.append(request.seeds),
        add(key, request, params),
    )
    gone = loop.submit(Request([1], [5]), GREEDY)
    kept = loop.submit(Request([2], [6]), GREEDY)
    assert gone.cancel()  # its client went away before the worker stepped
    loop.step(engine)
    assert added == [[6]] and kept.result(timeout=0)[0].token_ids == [6, 1]
