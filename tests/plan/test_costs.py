"""Throughput formulas, checked against numbers worked out by hand."""

import math

import pytest

from cadence.backend.ray.weights import BUCKET_BYTES
from cadence.plan.costs import (
    SYNC_BUCKET_BYTES,
    DeviceSpec,
    ModelShape,
    Profile,
    Throughput,
    from_hardware,
)

# 1 B parameters in bf16 (2 GB of weights), 10 layers of width 1000, no grouped-query attention
MODEL = ModelShape(params=1e9, layers=10, hidden=1000, bytes_per_param=2.0)
# round numbers, every efficiency 1: 1 PFLOP/s, 1 TB/s, 10 GB
DEVICE = DeviceSpec(
    name="round",
    flops=1e15,
    mem_bw=1e12,
    memory_bytes=10e9,
    mem_efficiency=1.0,
    decode_efficiency=1.0,
    prefill_efficiency=1.0,
    train_mfu=1.0,
    network_bw=1e10,
    sync_bw=1e10,
    sync_latency_s=0.1,
    step_overhead_s=0.0,
    kv_memory_fraction=1.0,
)


def test_formulas_from_peak_rates():
    t = from_hardware(MODEL, DEVICE, seq_tokens=1000, reference_model=False).separate
    assert MODEL.kv_bytes_per_token == 2 * 10 * 1000 * 2  # keys and values, every layer: 40 kB
    assert t.decode_step_s == pytest.approx(2e9 / 1e12)  # read the weights once: 2 ms
    assert t.decode_per_seq_s == pytest.approx(2e9 / 1e15)  # 2 N FLOPs per token: 2 us
    assert t.decode_per_ctx_token_s == pytest.approx(40e3 / 1e12)  # read one token's K/V
    assert t.prefill_per_token_s == pytest.approx(2e9 / 1e15)
    # forward 2 N + 2 L h S = 2e9 + 2e7 FLOPs per token, x 3 with the backward
    assert t.train_per_token_s == pytest.approx(3 * (2e9 + 2e7) / 1e15)
    # broadcast (the default): the snapshot's device copy, latency + weights over the link
    assert t.load_s == pytest.approx(2e9 / 1e12 + 0.1 + 2e9 / 1e10)
    assert t.allreduce_s == pytest.approx(2 * 2e9 / 1e10)
    assert t.kv_cache_bytes == pytest.approx(10e9 - 2e9 - SYNC_BUCKET_BYTES)  # one bucket beside
    with_ref = from_hardware(MODEL, DEVICE, seq_tokens=1000, reference_model=True).separate
    assert with_ref.train_per_token_s == pytest.approx(t.train_per_token_s * 4 / 3)


def test_tensor_parallel_engine_has_the_rates_of_its_devices():
    one = from_hardware(MODEL, DEVICE, seq_tokens=100, reference_model=False).separate
    two = from_hardware(
        MODEL, DEVICE, seq_tokens=100, reference_model=False, engine_devices=2
    ).separate
    assert two.decode_step_s == pytest.approx(one.decode_step_s / 2)
    assert two.kv_cache_bytes == pytest.approx(2 * 10e9 - 2e9 - SYNC_BUCKET_BYTES)


def test_each_weight_transport_costs_its_copies():
    # 2 GB of weights: 2 ms a device copy (1 TB/s), 0.2 s over the link, the network or a host
    # copy (10 GB/s each), 0.1 s of latency
    def costs(transport):
        profile = from_hardware(
            MODEL, DEVICE, seq_tokens=100, reference_model=False, weight_sync=transport
        )
        return profile.separate, profile.colocated

    broadcast, colocated = costs("broadcast")
    assert broadcast.publish_s == pytest.approx(0.002 + 0.1 + 0.2)  # the learner waits on the wire
    assert broadcast.load_s == pytest.approx(0.1 + 0.2 + 0.002)
    assert broadcast.sync_copies == 2 and broadcast.sync_extra_bytes == SYNC_BUCKET_BYTES
    assert SYNC_BUCKET_BYTES == BUCKET_BYTES  # what the broadcast really holds per engine
    store, _ = costs("object_store")
    assert store.publish_s == pytest.approx(0.1 + 0.2 + 0.2)  # device to host, then the put
    assert store.load_s == pytest.approx(0.2 + 0.2)  # to the engine's node, then into the engine
    assert store.sync_copies == 4 and store.sync_extra_bytes == 0
    assert store.kv_cache_bytes == pytest.approx(10e9 - 2e9)
    shm, _ = costs("shm")
    assert (shm.publish_s, shm.load_s) == pytest.approx((0.1 + 0.2, 0.2))
    # colocated: the engine shares the learner's device: one local copy, whatever the transport
    assert colocated.publish_s == 0 and colocated.load_s == pytest.approx(0.002)
    assert colocated.sync_copies == 1 and colocated.kv_cache_bytes == pytest.approx(8e9)
    with pytest.raises(ValueError, match="pigeon"):
        costs("pigeon")


def test_decode_time_is_the_sum_of_its_steps():
    t = Throughput(0.5, 0.01, 0.001, 0.0, 0.0)
    active, context, steps = 7, 300, 13
    by_step = sum(0.5 + 0.01 * active + 0.001 * (context + active * i) for i in range(steps))
    assert t.decode_time(active, context, steps) == pytest.approx(by_step)


def test_slots_are_capped_by_the_kv_cache():
    t = Throughput(0, 0, 0, 0, 0, kv_cache_bytes=1e9, kv_bytes_per_token=1e5, train_state_bytes=8e9)
    assert t.slots(256, seq_tokens=1000) == 10  # 1 GB / (100 kB x 1000 tokens)
    assert t.slots(4, seq_tokens=1000) == 4
    assert t.slots(256, seq_tokens=1000, colocated_devices=16) == 5  # 0.5 GB of training state
    assert Throughput(0, 0, 0, 0, 0).slots(256, seq_tokens=1e6) == 256  # no memory model


def test_profile_round_trips_through_json_values():
    p = from_hardware(MODEL, DEVICE, seq_tokens=100, reference_model=False)
    q = Profile.from_dict(p.to_dict())
    assert q.separate == p.separate and q.colocated == p.colocated
    inf = Throughput(0, 0, 0, 0, 0)
    assert math.isinf(Throughput.from_dict(inf.to_dict()).kv_cache_bytes)
    with pytest.raises(ValueError, match="unknown throughput field"):
        Throughput.from_dict({"decode_step": 1.0})


def test_memory_per_learner_rank():
    t = from_hardware(MODEL, DEVICE, seq_tokens=1000, reference_model=True).separate
    # 16 bytes of training state per parameter (16 GB) and the 2 GB reference; FSDP shards both
    # and holds one gathered layer (2 GB / 10) and its gradient on top
    assert t.rank_memory(4, "fsdp") == pytest.approx((16e9 + 2e9) / 4 + 2 * 0.2e9)
    # DDP: a whole replica per rank, and beside its float32 masters the bf16 model and a
    # micro-batch's bf16 gradients (2 + 2 bytes a parameter: 20, not 16)
    assert t.rank_memory(4, "ddp") == pytest.approx(16e9 + 2e9 + 2 * 2e9)
    assert t.train_memory_bytes == pytest.approx(0.9 * 10e9)
    assert not t.fits(1) and not t.fits(2) and t.fits(3)  # 6.4 GB on 3 ranks, 9.4 GB on 2
    assert not t.fits(64, "ddp")


def test_fsdp_gathers_hide_behind_compute_until_they_take_longer():
    t = from_hardware(MODEL, DEVICE, seq_tokens=1000, reference_model=False).separate
    per_token = 3 * (2e9 + 2e7) / 1e15
    gathers = 3 * 2e9 / 1e10 * 3 / 4  # three passes over the weights, (D - 1) / D of them, D = 4
    assert t.train_time(1e6, 4) == pytest.approx(1e6 * per_token / 4)  # 0.76 s > 0.45 s: hidden
    assert t.train_time(1e5, 4) == pytest.approx(gathers)  # 0.08 s of compute waits for them
    assert t.train_time(1e5, 4, "ddp") == pytest.approx(1e5 * per_token / 4)  # at the step only
    assert t.train_time(1e5, 1) == pytest.approx(1e5 * per_token)  # one rank gathers nothing
    # the step: FSDP ranks update their shard, DDP ranks the whole model
    assert t.optimizer_time(4) == pytest.approx(16e9 / 1e12 / 4 + 2 * 2e9 / 1e10)
    assert t.optimizer_time(4, "ddp") == pytest.approx(16e9 / 1e12 + 2 * 2e9 / 1e10)
