"""The weight gate (the version barrier) over the fake transport: when a version is written, when
the learner may go on, and what a replaced worker changes; and the learner's weights reaching an
engine in its own process."""

import threading
import time

import pytest
import torch

from cadence.backend import InMemoryWeights, learner_sync
from cadence.engine import EngineWeights, ScriptedEngine, load_into
from cadence.pipeline.gate import WeightGate


def _model(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_the_fake_transport_holds_the_newest_version_and_records_each():
    weights = InMemoryWeights(_model(0.0))
    weights.publish(_model(3.0), version=0)
    weights.publish(_model(5.0), version=1)
    assert weights.versions == [0, 1]
    worker = _model(-1.0)
    load_into(worker, weights.tensors)
    assert torch.equal(worker.weight, torch.full((1, 2), 5.0))


def test_publish_waits_for_every_worker_to_load_it_and_queues_one_sync():
    weights = InMemoryWeights(_model(0.0))
    gate = WeightGate(weights, num_workers=2, timeout_s=10)
    done = threading.Event()

    def learner():
        gate.publish(_model(1.0), version=0, wait=True)
        done.set()

    thread = threading.Thread(target=learner)
    thread.start()
    deadline = time.monotonic() + 5
    while not weights.versions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert weights.versions == [0]  # written at once: no worker held an older version
    assert gate.take() == ([0], -1)  # one sync for the producer; nothing released yet
    gate.acked(0, 0)
    assert not done.wait(0.3)  # one worker of two has it: the learner still waits
    gate.acked(1, 0)
    assert done.wait(5)
    thread.join()
    gate.release(0)
    assert gate.take() == ([], 0)


def test_a_new_version_is_not_written_while_a_worker_may_still_read_the_last():
    weights = InMemoryWeights(_model(0.0))
    gate = WeightGate(weights, num_workers=2, timeout_s=10)
    gate.publish(_model(1.0), version=0, wait=False)  # off-policy: the learner goes on
    gate.release(0)
    gate.acked(0, 0)
    thread = threading.Thread(target=gate.publish, args=(_model(2.0), 1, False))
    thread.start()
    time.sleep(0.3)
    assert weights.versions == [0]  # worker 1 has not loaded version 0 yet
    gate.acked(1, 0)
    thread.join(timeout=5)
    assert weights.versions == [0, 1]
    assert gate.take()[0] == [0, 1]


def test_a_replaced_worker_blocks_publishing_until_it_loads_and_learns_the_version_held():
    weights = InMemoryWeights(_model(0.0))
    gate = WeightGate(weights, num_workers=1, timeout_s=0.5)
    gate.publish(_model(1.0), version=0, wait=False)
    gate.release(0)
    gate.acked(0, 0)
    assert gate.reset(0) == 0  # the replacement is to be synced to version 0
    with pytest.raises(TimeoutError, match="workers did not load the previous weights"):
        gate.publish(_model(2.0), version=1, wait=False)
    assert weights.versions == [0]
    gate.acked(0, 0)
    gate.publish(_model(2.0), version=1, wait=False)
    assert weights.versions == [0, 1]


def test_a_failure_elsewhere_ends_the_wait_with_that_failure():
    failure: list[BaseException] = []

    def check():
        if failure:
            raise failure[0]

    gate = WeightGate(InMemoryWeights(_model(0.0)), num_workers=1, timeout_s=30, check=check)

    def fail():
        failure.append(RuntimeError("worker 0 failed"))
        gate.wake()

    threading.Timer(0.2, fail).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 0 failed"):
        gate.publish(_model(1.0), version=0, wait=True)
    assert time.monotonic() - start < 5


def test_a_version_already_released_is_not_written_again():
    weights = InMemoryWeights(_model(0.0))
    gate = WeightGate(weights, num_workers=1, timeout_s=5)
    gate.publish(_model(1.0), version=0, wait=False)
    gate.release(0)
    gate.publish(_model(9.0), version=0, wait=True)
    assert weights.versions == [0]


class _OwnCopy(ScriptedEngine):
    """An engine with its own copy of the weights: records what it is sent."""

    owns_weights = True

    def __init__(self) -> None:
        super().__init__(lambda ids, seed: [1])
        self.loaded: list[tuple[dict, object]] = []

    def load_weights(self, tensors, version=None) -> None:
        self.loaded.append(({n: t.clone() for n, t in dict(tensors).items()}, version))

    def held_fingerprint(self, expected):
        from cadence.models.fingerprint import held

        return held(self.loaded[-1][0], expected) if self.loaded else {}


def test_the_learner_syncs_only_an_engine_that_keeps_its_own_copy():
    learner = _model(2.0)
    shared = ScriptedEngine(lambda ids, seed: [1])
    assert learner_sync(EngineWeights(shared, learner), learner) is None  # it reads `learner`
    own = _OwnCopy()
    sync = learner_sync(EngineWeights(own, _model(0.0)), learner)
    sync(4)
    with torch.no_grad():
        learner.weight.fill_(7.0)
    sync(5)
    assert [v for _, v in own.loaded] == [4, 5]
    assert [t["weight"].flatten().tolist() for t, _ in own.loaded] == [[2.0, 2.0], [7.0, 7.0]]


def test_a_worker_reporting_a_version_never_published_is_an_error():
    gate = WeightGate(InMemoryWeights(_model(0.0)), num_workers=1, timeout_s=10)
    gate.publish(_model(1.0), version=0, wait=False)
    gate.acked(0, 0)
    with pytest.raises(
        RuntimeError, match="reports weights of version 3; the learner published up to 0"
    ):
        gate.acked(0, 3)
    with pytest.raises(RuntimeError, match="had loaded 0"):
        gate.acked(0, -1)  # going back
