"""The engine thread behind `cadence serve`: a request that makes the engine raise fails alone and
the rest are served; an engine that serves no more says so, and no caller is left waiting."""

import json
import threading

import pytest

from cadence.engine import (
    BatchStepper,
    ContinuousEngine,
    Request,
    SamplingParams,
    ScriptedEngine,
)
from cadence.serve.engine_loop import EngineBroken, EngineLoop, RequestFailed

POISON = 666  # a prompt token the scripted engines below raise on
WAIT_S = 60  # generous: the machine running the suite may be busy


def _script(prompt_ids, seed):
    if POISON in prompt_ids:
        raise IndexError("index out of range in self")
    return [prompt_ids[0], seed % 7, 1]


class Held:
    """Holds the engine's first step until released, so that what is submitted meanwhile joins
    the engine together at the next step (one batch, as under load)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def script(self, prompt_ids, seed):
        if prompt_ids == [0]:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return _script(prompt_ids, seed)

    def submit_together(self, loop, requests, params):
        first = loop.submit(Request([0], [0]), params)
        assert self.entered.wait(WAIT_S)
        futures = [loop.submit(r, params) for r in requests]
        self.release.set()
        assert first.result(WAIT_S)
        return futures


class FailsInBatches:
    """A flaky engine: any batch of two or more requests raises, each request alone works."""

    def __init__(self, script):
        self.inner = ScriptedEngine(script)

    def generate(self, requests, params):
        if len(requests) > 1:
            raise RuntimeError("device error")
        return self.inner.generate(requests, params)


def test_a_step_that_raises_fails_only_the_request_that_caused_it(tiny):
    """Issue 30: an id the model has no embedding for raised inside the step, the loop kept the
    failure, and every later request failed with 'the engine failed'."""
    tokenizer, model = tiny

    def fresh():
        return ContinuousEngine(model, tokenizer, max_num_seqs=8)

    params = SamplingParams(max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    prompt = tokenizer("Question: 2 + 2?", add_special_tokens=False)["input_ids"]
    good = [Request(prompt, [s, s + 1]) for s in range(5)]
    loop = EngineLoop(fresh(), renew=fresh)
    try:
        futures = [
            loop.submit(r, params) for r in [*good[:3], Request([1_000_000], [9]), *good[3:]]
        ]
        with pytest.raises(RequestFailed, match="IndexError"):
            futures[3].result(WAIT_S)
        want = fresh().generate(good, params)
        got = [f.result(WAIT_S) for f in futures[:3] + futures[4:]]
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
        later = loop.submit(good[0], params).result(WAIT_S)
        assert [c.token_ids for c in later] == [c.token_ids for c in want[0]]
        assert loop.broken is None
    finally:
        loop.close()


def test_in_one_batch_the_request_at_fault_is_found_and_the_rest_answered():
    held = Held()
    loop = EngineLoop(ScriptedEngine(held.script), renew=lambda: ScriptedEngine(_script))
    params = SamplingParams(max_new_tokens=8)
    requests = [Request([10 + i], [i]) for i in range(7)]
    requests[5] = Request([10, POISON], [5])
    try:
        futures = held.submit_together(loop, requests, params)
        for i, (future, request) in enumerate(zip(futures, requests, strict=True)):
            if i == 5:
                with pytest.raises(RequestFailed, match="this request failed in the engine"):
                    future.result(WAIT_S)
            else:
                (c,) = future.result(WAIT_S)
                assert c.token_ids == _script(request.prompt_ids, request.seeds[0])
        assert loop.broken is None
    finally:
        loop.close()


def test_a_request_the_engine_refuses_fails_alone_and_the_loop_goes_on(tiny):
    """Issue 30: `_admit()` ran outside the `try`: an `add` that raised killed the loop thread and
    left every caller waiting forever."""
    tokenizer, model = tiny
    loop = EngineLoop(ContinuousEngine(model, tokenizer, max_num_seqs=8))
    params = SamplingParams(max_new_tokens=4)
    try:
        refused = loop.submit(Request([5, 6], seeds=[]), params)  # no seed: add() raises
        with pytest.raises(RequestFailed, match="needs at least one seed"):
            refused.result(WAIT_S)
        (c,) = loop.submit(Request([5, 6], [1]), params).result(WAIT_S)
        assert len(c.token_ids) >= 1
        assert loop.broken is None
    finally:
        loop.close()


def test_an_engine_that_fails_every_request_is_broken_and_answers_at_once():
    def always(prompt_ids, seed):
        raise RuntimeError("CUDA error: an illegal memory access")

    loop = EngineLoop(
        ScriptedEngine(always), renew=lambda: ScriptedEngine(always), max_failures_in_a_row=4
    )
    params = SamplingParams()
    try:
        with pytest.raises(RequestFailed, match="illegal memory access"):
            loop.submit(Request([1], [1]), params).result(WAIT_S)  # failures 1 and 2: its own?
        assert loop.broken is None
        with pytest.raises(EngineBroken, match="4 engine steps in a row failed"):
            loop.submit(Request([2], [1]), params).result(WAIT_S)  # 3 and 4: no, the engine's
        assert "illegal memory access" in loop.broken
        with pytest.raises(EngineBroken):
            loop.submit(Request([3], [1]), params).result(0)  # answered at once
    finally:
        loop.close()


def test_failures_that_no_request_causes_alone_break_the_engine_after_three():
    held = Held()
    loop = EngineLoop(FailsInBatches(held.script), renew=lambda: FailsInBatches(held.script))
    params = SamplingParams()
    try:
        for incident in range(3):
            assert loop.broken is None
            pair = [Request([10 + incident], [1]), Request([20 + incident], [2])]
            held.entered.clear()
            held.release.clear()
            futures = held.submit_together(loop, pair, params)
            assert [f.result(WAIT_S)[0].token_ids[0] for f in futures] == [
                10 + incident,
                20 + incident,
            ]
        assert "3 engine failures in a row that no request caused alone" in loop.broken
        assert "device error" in loop.broken
    finally:
        loop.close()


def test_without_a_way_to_restart_the_engine_one_failure_breaks_it_and_everyone_hears():
    held = Held()
    loop = EngineLoop(ScriptedEngine(held.script))
    params = SamplingParams()
    try:
        futures = held.submit_together(loop, [Request([1], [1]), Request([POISON], [1])], params)
        for future in futures:
            with pytest.raises(EngineBroken, match="cannot be restarted"):
                future.result(WAIT_S)
        assert "index out of range" in loop.broken
    finally:
        loop.close()


class DiesOnSecondLook(BatchStepper):
    """An engine whose `busy` raises once work was added: a fault outside `add` and `step`."""

    @property
    def busy(self):
        if self.pending:
            raise RuntimeError("lost the device")
        return False


def test_a_loop_thread_that_dies_says_so_and_leaves_no_caller_waiting():
    loop = EngineLoop(DiesOnSecondLook(ScriptedEngine(_script)))
    params = SamplingParams()
    with pytest.raises(EngineBroken, match="the engine thread died: RuntimeError"):
        loop.submit(Request([1], [1]), params).result(WAIT_S)
    assert "lost the device" in loop.broken
    with pytest.raises(EngineBroken):
        loop.submit(Request([1], [1]), params).result(0)
    loop.close()


def test_a_round_takes_every_waiting_request_with_its_params_and_the_others_go_next():
    held, batches = Held(), []

    class Recording(ScriptedEngine):
        def generate(self, requests, params):
            batches.append([r.prompt_ids[0] for r in requests])
            return super().generate(requests, params)

    loop = EngineLoop(Recording(held.script))
    sampled, greedy = SamplingParams(), SamplingParams(temperature=0)
    try:
        first = loop.submit(Request([0], [0]), sampled)
        assert held.entered.wait(WAIT_S)
        mix = [(1, sampled), (2, greedy), (3, sampled), (4, greedy), (5, sampled)]
        futures = [loop.submit(Request([p], [1]), params) for p, params in mix]
        held.release.set()
        assert first.result(WAIT_S)
        assert [f.result(WAIT_S)[0].token_ids[0] for f in futures] == [1, 2, 3, 4, 5]
        assert batches == [[0], [1, 3, 5], [2, 4]]
    finally:
        loop.close()


def test_the_servers_engine_is_restarted_after_a_failed_step(model_dir):
    """`build_server` (what `cadence serve` runs) gives its loop a way to start a fresh engine."""
    from cadence.serve import build_server

    server = build_server(str(model_dir), max_num_seqs=4, max_tokens=8)
    try:
        config = json.loads((model_dir / "config.json").read_text())
        assert server.limits.vocab_size == config["vocab_size"]
        assert server.limits.max_positions == config["max_position_embeddings"]
        bad = server.loop.submit(Request([1_000_000], [1]), server.params)
        with pytest.raises(RequestFailed, match="IndexError"):
            bad.result(WAIT_S)
        (c,) = server.loop.submit(Request([5, 6], [1]), server.params).result(WAIT_S)
        assert c.token_ids and server.loop.broken is None
    finally:
        server.close()
