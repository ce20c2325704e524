"""The worker process's loop, run in-process: streaming results and weights that change only
between requests."""

import queue
import threading

import torch

from cadence.backend import WorkerLoop
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.rollout import RolloutWorker
from cadence.types import Prompt


def _loop(inbox, outbox):
    model = torch.nn.Linear(2, 2)
    tensors = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    worker = RolloutWorker(
        ScriptedEngine(lambda ids, seed: [1, 2]),
        tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
        reward=lambda prompt, response, answer: 1.0,
        sampling=SamplingParams(max_new_tokens=4),
        group_size=2,
        run_seed=0,
    )
    return model, WorkerLoop(0, worker, lambda version: load_into(model, tensors), inbox, outbox)


def test_a_sync_behind_a_busy_engine_waits_and_so_does_the_work_behind_it():
    inbox, outbox = queue.Queue(), queue.Queue()
    model, loop = _loop(inbox, outbox)
    prompts = [Prompt(f"p{i}", "x" * (i + 1), "1", index=i) for i in range(2)]
    for message in [
        ("sync", (0, None)),
        ("rollout", (0, prompts[:1], 0)),
        ("sync", (1, None)),  # arrives while task 0 is in the engine
        ("rollout", (1, prompts[1:], 1)),
    ]:
        inbox.put(message)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    got = [outbox.get(timeout=30) for _ in range(5)]
    inbox.put(("stop", None))  # stop drops work in flight, so it comes last
    thread.join(timeout=30)
    assert not thread.is_alive() and outbox.empty()
    assert got[0] == ("ready", 0, None)
    got = got[1:]
    kinds = [(kind, payload if kind == "ack" else payload.task_id) for kind, _, payload in got]
    assert kinds == [("ack", 0), ("groups", 0), ("ack", 1), ("groups", 1)]
    results = [p for kind, _, p in got if kind == "groups"]
    assert [g.policy_version for r in results for g in r.groups] == [0, 1]
    assert all(r.task_done for r in results)
    assert all(r.start <= r.end for r in results)
    assert all((p == 7.0).all() for p in model.parameters())  # the published weights arrived
