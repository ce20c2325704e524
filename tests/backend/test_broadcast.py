"""`pipeline.weight_sync = "broadcast"` (issue 40): a process group of the weights' own, so it forms
beside the default group a vLLM worker already holds (the second default group crashed the
run), and versions sent in buckets: one bucket of extra memory on a worker, never a flat copy of
the model there. gloo on CPU; the members are threads of this process,
whose default group stands for vLLM's; the learner publishes and trains on before a worker
takes the version, as in a run."""

import threading

import pytest
import torch
import torch.distributed as dist

from cadence.backend.ray.weights import (
    BroadcastReceiver,
    BroadcastWeights,
    num_bytes,
    plan_buckets,
)
from cadence.engine import EngineWeights, ScriptedEngine
from tiny_models import tiny_causal_lm

BUCKET = 8 << 10  # 8 KiB: the tiny model's 29 tensors make several buckets


@pytest.fixture
def default_group(tmp_path):
    """torch.distributed's default group in this process, as vLLM's worker makes it."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'default'}", rank=0, world_size=1
        )
    yield
    if made:
        dist.destroy_process_group()


def _model(seed: int):
    torch.manual_seed(seed)
    model = tiny_causal_lm("llama", 64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1)
    return model


class _OwnCopy(ScriptedEngine):
    """An engine with its own copy (as vLLM): takes what arrives as a stream, in order."""

    owns_weights = True

    def __init__(self, model):
        super().__init__(lambda ids, seed: [1])
        self.model, self.versions = model, []

    def load_weights(self, tensors, version=None):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in tensors:
                params[name].copy_(t)
        self.versions.append(version)


@pytest.mark.parametrize("own_copy", [False, True])
def test_a_broadcast_in_buckets_forms_beside_the_default_group_and_delivers_the_weights(
    default_group, tmp_path, own_copy
):
    learner, worker = _model(1), _model(2)
    engine = _OwnCopy(worker) if own_copy else ScriptedEngine(lambda ids, seed: [1])
    sender = BroadcastWeights(learner, bucket_bytes=BUCKET)
    receiver = BroadcastReceiver(EngineWeights(engine, worker), "cpu", bucket_bytes=BUCKET)
    init = f"file://{tmp_path / 'weights'}"
    joined = threading.Thread(target=receiver.join, args=("gloo", init, 1, 2, {}, 60))
    joined.start()
    sender.join(init, 2, {}, 60)
    joined.join()
    try:
        for version in (1, 2):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(0.5)
            sent = {n: p.detach().clone() for n, p in learner.named_parameters()}
            # as in a run: the learner publishes and trains on; the worker takes the version
            # later, when its loop acts on the sync
            sender.publish(learner, version)
            with torch.no_grad():
                for p in learner.parameters():
                    p.mul_(-1.0)  # the next optimizer step, before the worker has loaded
            receiver.load(version)
            for name, p in worker.named_parameters():
                assert torch.equal(p, sent[name]), name
            with torch.no_grad():
                for p in learner.parameters():
                    p.mul_(-1.0)
    finally:
        sender.close()
        receiver.close()
    assert dist.is_initialized()  # the default group is untouched
    if own_copy:
        assert engine.versions == [1, 2]
    assert len(sender.buckets) > 3
    largest = max(b.numel * b.dtype.itemsize for b in sender.buckets)
    assert largest <= max(BUCKET, max(p.numel() * 4 for p in learner.parameters()))
    assert sender.buffer_bytes == num_bytes(learner)  # the learner's snapshot of the version
    assert receiver.buffer_bytes == largest  # a worker's: one bucket, not the model
    assert receiver.buffer_bytes < num_bytes(learner) / 3


def test_buckets_keep_the_order_and_cut_at_the_size_and_at_a_dtype_change():
    model = tiny_causal_lm("llama", 64)
    model.lm_head.to(torch.bfloat16)
    buckets = plan_buckets(model, BUCKET)
    names = [name for b in buckets for name, *_ in b.entries]
    assert names == [name for name, _ in model.named_parameters()]
    for b in buckets:
        dtypes = {dict(model.named_parameters())[name].dtype for name, *_ in b.entries}
        assert dtypes == {b.dtype}
        assert len(b.entries) == 1 or b.numel * b.dtype.itemsize <= BUCKET
    assert buckets[-1].dtype == torch.bfloat16


class _Store:
    """Ray's object store as the object-store transport uses it: `put` copies every array once
    into the store (as Ray serialises numpy arrays out of band), `get` hands back the store's
    arrays read-only, without a copy (as Ray does for numpy arrays on the same node)."""

    def __init__(self):
        self.puts, self.put_args = 0, []

    def put(self, arrays):
        self.puts += 1
        self.put_args.append(arrays)
        self.held = {name: a.copy() for name, a in arrays.items()}
        for a in self.held.values():
            a.flags.writeable = False
        return "ref"

    def get(self, ref):
        return self.held


def test_the_object_store_copies_a_version_twice_into_the_engine(monkeypatch):
    import sys
    from types import SimpleNamespace

    import numpy as np

    from cadence.backend.ray.weights import ObjectStoreReceiver, ObjectStoreWeights

    store = _Store()
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(put=store.put, get=store.get))
    learner, worker = _model(1), _model(2)
    sender = ObjectStoreWeights(learner)
    loaded = []
    weights = EngineWeights(ScriptedEngine(lambda ids, seed: [1]), worker)
    load = weights.load
    monkeypatch.setattr(weights, "load", lambda t, v: (loaded.append(t), load(t, v))[1])
    receiver = ObjectStoreReceiver(weights)
    sender.publish(learner, 1)
    receiver.stage(1, sender.message(1))
    receiver.load(1)
    # copy 1, the put: the learner's parameters reach it as views, not copies of their own
    params = dict(learner.named_parameters())
    (arrays,) = store.put_args
    assert store.puts == 1 and set(arrays) == set(params)
    for name, a in arrays.items():
        assert np.shares_memory(a, params[name].detach().numpy()), name
    # the worker's read is the store's memory; copy 2 puts it into the engine's model
    (tensors,) = loaded
    for name, t in tensors.items():
        assert np.shares_memory(t.numpy(), store.held[name]), name
    for name, p in worker.named_parameters():
        assert torch.equal(p, params[name]) and p.data_ptr() != params[name].data_ptr()
