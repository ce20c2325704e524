"""The simulation against cases worked out by hand (no timing: simulated seconds only).

Costs are chosen so that every figure is a small integer: a decode step costs 1 s whatever the
batch, so a response of R tokens takes R s, and a micro-batch costs a fixed number of seconds.
"""

import numpy as np
import pytest

from cadence.plan.costs import Throughput
from cadence.plan.lengths import ResponseLengths
from cadence.plan.sim import Shape, Workload, measured, simulate

P_PUBLISH, L_LOAD, O_STEP = 1.0, 2.0, 3.0


def _cost(microbatch_s: float = 10.0, **kw) -> Throughput:
    base = dict(
        decode_step_s=1.0,
        decode_per_seq_s=0.0,
        decode_per_ctx_token_s=0.0,
        prefill_per_token_s=0.0,
        train_per_token_s=0.0,
        train_microbatch_s=microbatch_s,
        optimizer_update_s=O_STEP,
        publish_s=P_PUBLISH,
        load_s=L_LOAD,
    )
    return Throughput(**(base | kw))


def _fixed(iterations: int, n: int, G: int, tokens: int) -> np.ndarray:
    return np.full((iterations, n, G), tokens)


def test_periodic_is_max_of_phases_plus_tail_when_balanced():
    # 4 groups of G=2, every response 10 tokens; an engine holds one group at a time (slots = G),
    # so groups finish at 10, 20, 30, 40 s; training a group (micro-batch of 1) takes 10 s.
    n, G, R = 4, 2, 10
    work = Workload(n, G, prompt_tokens=1, micro_batch_groups=1, max_num_seqs=G)
    lengths = _fixed(3, n, G, R)
    t_gen = t_train = n * R  # 40 s each: balanced
    periodic = simulate(Shape("periodic", "separate", 1, 1), work, _cost(), lengths)
    # tail: the first group's generation before training starts, the step, and the weight sync
    tail = R + O_STEP + P_PUBLISH + L_LOAD
    assert periodic.wall_s == pytest.approx(max(t_gen, t_train) + tail)  # 56 s
    sync = simulate(Shape("sync", "separate", 1, 1), work, _cost(), lengths)
    assert sync.wall_s == pytest.approx(t_gen + t_train + O_STEP + P_PUBLISH + L_LOAD)  # 86 s
    assert periodic.staleness == sync.staleness == {0: n * len(measured(sync.shape, 3))}


def test_one_straggler_delays_sync_by_its_full_length():
    # Every engine slot is free (max_num_seqs 64 > 8 samples): generation lasts as long as the
    # longest response. One response of 100 tokens instead of 10 adds 90 steps = 90 s.
    n, G = 4, 2
    work = Workload(n, G, prompt_tokens=1, micro_batch_groups=2, max_num_seqs=64)
    even = _fixed(3, n, G, 10)
    straggler = even.copy()
    straggler[:, 2, 1] = 100
    shape = Shape("sync", "separate", 1, 1)
    base = simulate(shape, work, _cost(), even)
    slow = simulate(shape, work, _cost(), straggler)
    assert slow.wall_s - base.wall_s == pytest.approx(90.0)


def test_continuous_batching_refills_a_slot_static_batching_waits_for_the_batch():
    # G = 1, ten prompts: one response of 100 tokens, nine of 10; two slots. Continuous: the long
    # one holds one slot for 100 s while the other slot serves the nine short ones (90 s).
    # Static, tasks of 2 prompts: [100, 10] takes 100 s, then four tasks of [10, 10], 10 s each.
    lengths = _fixed(3, 10, 1, 10)
    lengths[:, 0, 0] = 100
    cost = _cost(microbatch_s=0.0, optimizer_update_s=0.0, publish_s=0.0, load_s=0.0)
    shape = Shape("sync", "separate", 1, 1)
    common = dict(prompt_tokens=1, micro_batch_groups=10, max_num_seqs=2)
    cont = simulate(shape, Workload(10, 1, **common), cost, lengths)
    static = simulate(
        shape, Workload(10, 1, batching="static", prompts_per_task=2, **common), cost, lengths
    )
    assert cont.wall_s == pytest.approx(100.0)
    assert static.wall_s == pytest.approx(140.0)


def _long_tail(iterations: int, n: int = 16, G: int = 4, seed: int = 0) -> np.ndarray:
    dist = ResponseLengths("lognormal", mean=200, sigma=1.0)
    return dist.sample(np.random.default_rng(seed), (iterations, n, G), 2000)


def test_offpolicy_staleness_is_bounded_by_n_and_exactly_one_for_n_1():
    work = Workload(16, 4, prompt_tokens=32, micro_batch_groups=4, max_num_seqs=16)
    cost = _cost(microbatch_s=50.0, decode_per_seq_s=0.01)
    for n_stale in (1, 2, 3):
        shape = Shape("offpolicy", "separate", 2, 2, staleness=n_stale)
        result = simulate(shape, work, cost, _long_tail(2 * n_stale + 6))
        by_iteration = result.staleness_by_iteration
        assert max(by_iteration) == n_stale  # the bound is reached and never exceeded
        assert by_iteration[0] == 0  # nothing to be stale against yet
        if n_stale == 1:
            assert by_iteration[1:] == [1] * (len(by_iteration) - 1)


def test_offpolicy_zero_is_periodic():
    work = Workload(16, 4, prompt_tokens=32, micro_batch_groups=4, max_num_seqs=16)
    lengths = _long_tail(4)
    cost = _cost(decode_per_seq_s=0.01)
    periodic = simulate(Shape("periodic", "separate", 2, 2), work, cost, lengths)
    zero = simulate(Shape("offpolicy", "separate", 2, 2, staleness=0), work, cost, lengths)
    assert zero.iteration_ends == periodic.iteration_ends


def test_overlap_orders_the_modes_on_a_long_tail():
    # Same devices, same responses: streaming cannot be slower than waiting for the whole batch,
    # and running one version ahead cannot be slower than the barrier.
    work = Workload(16, 4, prompt_tokens=32, micro_batch_groups=4, max_num_seqs=16)
    cost = _cost(microbatch_s=20.0, decode_per_seq_s=0.01)
    lengths = _long_tail(8)
    walls = {
        mode: simulate(Shape(mode, "separate", 2, 2, staleness=1), work, cost, lengths).wall_s
        for mode in ("sync", "periodic", "offpolicy")
    }
    assert walls["offpolicy"] <= walls["periodic"] <= walls["sync"]


def test_busy_fractions_and_tokens_add_up():
    n, G, R, P = 4, 2, 10, 5
    work = Workload(n, G, prompt_tokens=P, micro_batch_groups=1, max_num_seqs=G)
    result = simulate(Shape("sync", "separate", 1, 1), work, _cost(), _fixed(3, n, G, R))
    assert result.tokens_per_iteration == n * G * (P + R)
    assert result.tpspd == pytest.approx(n * G * (P + R) / result.wall_s / 2)
    # the engine loads (2 s) and generates (40 s); the learner trains (40), steps, publishes
    assert result.inference_busy * result.wall_s == pytest.approx(L_LOAD + n * R)
    assert result.training_busy * result.wall_s == pytest.approx(n * 10 + O_STEP + P_PUBLISH)
    assert result.slot_utilization == pytest.approx(n * R / result.wall_s)


def test_colocated_sync_runs_generation_then_training_on_every_device():
    n, G, R = 4, 2, 10
    work = Workload(n, G, prompt_tokens=1, micro_batch_groups=1, max_num_seqs=G)
    cost = _cost(microbatch_s=8.0, publish_s=0.0, load_s=0.5)
    result = simulate(Shape("sync", "colocated", 4, 4), work, cost, _fixed(3, n, G, R))
    # four engines each generate one group (10 s); four micro-batches of 8 s; step 3 / 4 devices
    assert result.wall_s == pytest.approx(0.5 + R + n * 8.0 + O_STEP / 4)


def test_rejects_a_colocated_mode_other_than_sync():
    work = Workload(4, 2, prompt_tokens=1, micro_batch_groups=1)
    with pytest.raises(ValueError, match="colocated"):
        simulate(Shape("periodic", "colocated", 2, 2), work, _cost(), _fixed(3, 4, 2, 5))


def test_partial_rollouts_change_nothing_when_no_version_arrives_mid_sequence():
    # Learner-bound (a micro-batch takes 5000 s, generation of an iteration far less): every
    # engine is empty when a version is published, so partial rollouts have nothing to carry on.
    work = Workload(16, 4, prompt_tokens=32, micro_batch_groups=4, max_num_seqs=16)
    cost = _cost(microbatch_s=5000.0, decode_per_seq_s=0.01)
    lengths = _long_tail(8)
    off = simulate(Shape("offpolicy", "separate", 2, 2, staleness=1), work, cost, lengths)
    for kv in ("keep", "recompute"):
        shape = Shape("offpolicy", "separate", 2, 2, staleness=1, partial=kv)
        part = simulate(shape, work, cost, lengths)
        assert part.iteration_ends == pytest.approx(off.iteration_ends, rel=1e-9)
        assert part.staleness_by_iteration == off.staleness_by_iteration


def test_partial_rollouts_fill_the_tail_of_a_generation_bound_run():
    # Generation-bound on a long tail: without partial rollouts an engine finishes an old
    # version's stragglers nearly alone before it may load the next; with them, the next
    # iteration's samples fill the free slots at once. Re-prefilling the prefixes costs time.
    work = Workload(16, 4, prompt_tokens=32, micro_batch_groups=4, max_num_seqs=16)
    cost = _cost(microbatch_s=5.0, decode_per_seq_s=0.01, prefill_per_token_s=0.001)
    lengths = _long_tail(10)
    results = {
        kv: simulate(
            Shape("offpolicy", "separate", 2, 2, staleness=1, partial=kv), work, cost, lengths
        )
        for kv in ("", "keep", "recompute")
    }
    assert results["keep"].wall_s < 0.9 * results[""].wall_s
    assert results["keep"].wall_s < results["recompute"].wall_s
    assert results["keep"].slot_utilization > results[""].slot_utilization
    for r in results.values():
        assert max(r.staleness_by_iteration) <= 1
    assert results["keep"].shape.label == "partial-1"
    assert results["recompute"].shape.label == "partial-1-recompute"


def test_partial_rollouts_need_offpolicy_and_continuous_batching():
    work = Workload(4, 2, prompt_tokens=1, micro_batch_groups=1)
    with pytest.raises(ValueError, match="offpolicy"):
        simulate(
            Shape("periodic", "separate", 1, 1, partial="keep"), work, _cost(), _fixed(3, 4, 2, 5)
        )
    static = Workload(4, 2, prompt_tokens=1, micro_batch_groups=1, batching="static")
    shape = Shape("offpolicy", "separate", 1, 1, staleness=1, partial="keep")
    with pytest.raises(ValueError, match="continuous"):
        simulate(shape, static, _cost(), _fixed(5, 4, 2, 5))


def test_the_learner_is_timed_by_the_positions_its_layout_computes():
    # One group of G = 4 responses of 1, 1, 1 and 9 tokens to a 2-token prompt, 1 s a position:
    # packed computes 2 + 12 = 14 positions, prefix pads each response to 9: 2 + 36 = 38,
    # unpacked (no shared prompt) repeats the prompt too: 4 x (2 + 9) = 44.
    lengths = np.array([[[1, 1, 1, 9]]] * 3)
    cost = _cost(microbatch_s=0.0, train_per_token_s=1.0)
    shape = Shape("sync", "colocated", 1, 1)

    def busy(**kw) -> float:
        work = Workload(1, 4, prompt_tokens=2, micro_batch_groups=1, max_num_seqs=64, **kw)
        result = simulate(shape, work, cost, lengths)
        return result.wall_s - simulate(shape, work, _cost(microbatch_s=0.0), lengths).wall_s

    assert busy(layout="packed") == pytest.approx(14)  # seconds an iteration
    assert busy(layout="prefix") == pytest.approx(38)
    assert busy(layout="prefix", shared_prompt=False) == pytest.approx(44)
