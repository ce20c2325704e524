"""The sample store: readiness per field, exactly once per task, whole groups, blocking, close,
staleness, samplers, and bounded memory over a long run.

Rows here are numbered `index = group * G + index_in_group` so expected batches can be read off
by hand; values are strings naming row and field, so a wrong or missing value shows which.
"""

import pickle
import random
import sys
import threading
import time

import pytest

from cadence.dataplane import (
    LengthBalanced,
    SampleStore,
    StaleRowError,
    StoreClosed,
    in_order,
)
from cadence.types import SampleRow


def group_rows(group: int, size: int = 2, iteration: int = 0, version: int = 0, base=None):
    first = group * size if base is None else base
    return [SampleRow(first + i, group, i, size, iteration, version) for i in range(size)]


def values(rows, name: str) -> list[str]:
    return [f"{name}{r.index}" for r in rows]


def put(store: SampleStore, rows, *names: str) -> None:
    store.put(rows, {n: values(rows, n) for n in names})


def indices(batch) -> list[int]:
    return [r.index for r in batch.rows]


def wait_until_blocked(store: SampleStore, n: int = 1) -> None:
    """Until `n` gets are blocked inside the store (a bounded wait, not a fixed sleep)."""
    deadline = time.monotonic() + 5
    while store.stats()["waiting"] < n:
        assert time.monotonic() < deadline, "get never blocked"
        threading.Event().wait(0.001)


def test_a_row_is_ready_once_every_requested_field_is_written():
    store = SampleStore()
    rows = group_rows(0, size=3)
    put(store, rows, "prompt_ids")  # creates rows 0, 1, 2
    store.put(rows[:2], {"response_ids": values(rows[:2], "response_ids")})
    assert store.depth(["prompt_ids", "response_ids"], "reward") == 2
    batch = store.get(["prompt_ids", "response_ids"], 3, "reward", timeout=0, groups=False)
    # row 2 has no response yet: only rows 0 and 1, each with both fields
    assert indices(batch) == [0, 1]
    assert batch.data["prompt_ids"] == ["prompt_ids0", "prompt_ids1"]
    assert batch.data["response_ids"] == ["response_ids0", "response_ids1"]
    assert store.get(["reward"], 3, "train", timeout=0, groups=False).rows == []


def test_a_task_takes_each_row_once_and_two_tasks_each_take_every_row():
    store = SampleStore()
    put(store, group_rows(0) + group_rows(1), "x")
    assert indices(store.get(["x"], 3, "a", timeout=0, groups=False)) == [0, 1, 2]
    assert indices(store.get(["x"], 3, "a", timeout=0, groups=False)) == [3]
    assert len(store.get(["x"], 3, "a", timeout=0, groups=False)) == 0
    assert indices(store.get(["x"], 4, "b", timeout=0, groups=False)) == [0, 1, 2, 3]
    assert store.stats()["got"] == {"a": 4, "b": 4}


def test_groups_are_handed_out_whole_and_only_when_complete():
    store = SampleStore()
    g0, g1 = group_rows(0, size=3), group_rows(1, size=3)
    put(store, g0 + g1[:2], "x")  # group 1 lacks its third row
    assert indices(store.get(["x"], 2, "train", timeout=0)) == [0, 1, 2]  # batch_size: groups
    store.put(g1[2:], {})  # row 5 exists now, but without field x
    assert store.depth(["x"], "train", groups=True) == 0
    assert len(store.get(["x"], 2, "train", timeout=0)) == 0
    put(store, g1[2:], "x")
    assert store.depth(["x"], "train", groups=True) == 3
    assert indices(store.get(["x"], 2, "train", timeout=0)) == [3, 4, 5]


def test_a_group_partly_taken_row_by_row_is_never_handed_out_whole():
    store = SampleStore()
    put(store, group_rows(0), "x")
    store.get(["x"], 1, "mixed", timeout=0, groups=False)
    assert len(store.get(["x"], 1, "mixed", timeout=0)) == 0


def test_timeout_returns_what_is_ready_possibly_nothing():
    store = SampleStore()
    start = time.monotonic()
    assert len(store.get(["x"], 2, "t", timeout=0.05, groups=False)) == 0
    assert time.monotonic() - start >= 0.05
    put(store, group_rows(0, size=1), "x")
    assert indices(store.get(["x"], 2, "t", timeout=0.01, groups=False)) == [0]
    assert store.stats()["wait_s"]["t"] >= 0.06


def test_get_blocks_until_a_put_makes_enough_ready():
    store = SampleStore()
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get(["x"], 2, "t", timeout=10)))
    reader.start()
    wait_until_blocked(store)
    put(store, group_rows(0), "x")  # one group: one of the two asked for
    put(store, group_rows(1), "x")
    reader.join(5)
    assert not reader.is_alive() and indices(got[0]) == [0, 1, 2, 3]


def test_close_wakes_a_blocked_get_which_returns_what_is_ready_then_raises():
    store = SampleStore()
    put(store, group_rows(0), "x")
    got, errors = [], []

    def reader():
        try:
            while True:
                got.append(store.get(["x"], 5, "t", timeout=None))
        except StoreClosed as e:
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until_blocked(store)
    store.close()
    thread.join(5)
    assert not thread.is_alive()
    assert [indices(b) for b in got] == [[0, 1]] and len(errors) == 1
    with pytest.raises(StoreClosed):
        put(store, group_rows(1), "x")
    with pytest.raises(StoreClosed, match="nothing left for task 't'"):
        store.get(["x"], 1, "t", timeout=0)


def test_on_policy_returns_same_version_and_raises_on_any_other():
    store = SampleStore()
    put(store, group_rows(0, version=3), "x")
    assert indices(store.get(["x"], 1, "a", timeout=0, version=3)) == [0, 1]
    with pytest.raises(StaleRowError, match="policy_version 3, b is at 4"):
        store.get(["x"], 1, "b", timeout=0, version=4)  # behind, on-policy: a broken barrier
    with pytest.raises(StaleRowError, match="policy_version 3, c is at 2"):
        store.get(["x"], 1, "c", timeout=0, version=2, max_staleness=1)  # from the future


def test_off_policy_drops_and_counts_rows_staler_than_allowed():
    store = SampleStore()
    put(store, group_rows(0, version=2) + group_rows(1, version=3) + group_rows(2, version=4), "x")
    batch = store.get(["x"], 3, "train", timeout=0, version=4, max_staleness=1)
    # version 2 is 2 behind 4 > 1: dropped (consumed, counted); versions 3 and 4 trained
    assert indices(batch) == [2, 3, 4, 5] and batch.num_dropped == 2
    assert store.stats()["dropped"] == {"train": 2}
    assert len(store.get(["x"], 3, "train", timeout=0, version=4, max_staleness=1)) == 0
    assert indices(store.get(["x"], 3, "other", timeout=0)) == [0, 1, 2, 3, 4, 5]


def test_staleness_bounds_a_sample_by_its_oldest_token():
    # partial rollouts: a group begun under version 1 whose tokens are all of version 3 is one
    # version stale at 4, not three; one with a token of version 2 among them is two
    def rows(group, oldest):
        return [SampleRow(group * 2 + i, group, i, 2, 0, 1, oldest[i]) for i in range(2)]

    store = SampleStore()
    put(store, rows(0, [3, 3]) + rows(1, [3, 2]), "x")
    batch = store.get(["x"], 2, "train", timeout=0, version=4, max_staleness=1)
    assert indices(batch) == [0, 1] and batch.num_dropped == 2
    with pytest.raises(StaleRowError, match="oldest token of version 5, learner is at 4"):
        put(store, rows(2, [5, 5]), "x")
        store.get(["x"], 1, "learner", timeout=0, version=4, max_staleness=1)


def test_in_order_takes_the_oldest_index_first():
    store = SampleStore()
    rows = group_rows(0, size=4)
    for r in reversed(rows):
        put(store, [r], "x")
    assert indices(store.get(["x"], 2, "t", timeout=0, groups=False, sampler=in_order)) == [0, 1]


def test_length_balanced_gives_two_consumers_equal_token_counts():
    # 8 single-row groups with response lengths 1..8, taken by two consumers 4 at a time
    def fill() -> SampleStore:
        store = SampleStore()
        rows = [SampleRow(i, i, 0, 1, 0, 0) for i in range(8)]
        store.put(rows, {"response_ids": [[0] * (i + 1) for i in range(8)]})
        return store

    def totals(sampler) -> list[int]:
        store = fill()
        batches = [store.get(["response_ids"], 4, "t", timeout=0, sampler=sampler) for _ in "ab"]
        return [sum(len(ids) for ids in b.data["response_ids"]) for b in batches]

    # in order: 1+2+3+4 = 10 vs 5+6+7+8 = 26; balanced: 8+1+7+2 = 18 vs 6+3+5+4 = 18
    assert totals(in_order) == [10, 26]
    assert totals(LengthBalanced("response_ids")) == [18, 18]
    store = SampleStore()
    store.put([SampleRow(0, 0, 0, 1, 0, 0)], {"reward": [1.0]})
    with pytest.raises(ValueError, match="must ask for field 'response_ids'"):
        store.get(["reward"], 1, "t", timeout=0, sampler=LengthBalanced("response_ids"))


def test_a_sampler_may_not_invent_or_exceed():
    store = SampleStore()
    put(store, group_rows(0) + group_rows(1), "x")
    with pytest.raises(ValueError, match="2 units"):
        store.get(["x"], 1, "t", timeout=0, sampler=lambda units, n: list(units))
    with pytest.raises(ValueError, match="not offered"):
        store.get(["x"], 1, "t", timeout=0, sampler=lambda units, n: [tuple(list(units[0]))])
    assert store.stats()["got"] == {}  # a refused choice consumed nothing


def test_bad_puts_raise_and_write_nothing():
    store = SampleStore()
    rows = group_rows(0)
    with pytest.raises(ValueError, match="1 values for 2 rows"):
        store.put(rows, {"x": ["only one"]})
    put(store, rows, "x")
    with pytest.raises(ValueError, match=r"field\(s\) \['x'\] already written"):
        put(store, rows[:1], "y", "x")
    assert store.depth(["y"], "t") == 0  # all or nothing: y was not written either
    with pytest.raises(ValueError, match="conflicts with the stored"):
        put(store, [SampleRow(0, 0, 0, 2, 0, 7)], "z")
    with pytest.raises(ValueError, match="disagree on group_size or iteration"):
        put(store, [SampleRow(9, 0, 1, 3, 0, 0)], "x")
    with pytest.raises(ValueError, match="disagree on group_size or iteration"):
        put(store, [SampleRow(9, 5, 0, 2, 0, 0), SampleRow(10, 5, 1, 2, 1, 0)], "x")
    with pytest.raises(ValueError, match="share an index_in_group"):
        put(store, [SampleRow(9, 0, 1, 2, 0, 0)], "x")
    with pytest.raises(ValueError, match="appears twice in one put"):
        put(store, [SampleRow(9, 5, 0, 2, 0, 0)] * 2, "x")
    with pytest.raises(ValueError, match="index_in_group outside"):
        put(store, [SampleRow(9, 5, 2, 2, 0, 0)], "x")
    assert store.num_rows == 2


def test_clear_frees_an_iteration_and_ignores_late_writes_to_it():
    store = SampleStore()
    put(store, group_rows(0, iteration=0) + group_rows(1, iteration=1), "x")
    assert store.clear(0) == 2 and store.num_rows == 2
    put(store, group_rows(0, iteration=0), "reward")  # a stage finishing a freed row
    assert store.num_rows == 2 and store.stats()["late_rows"] == 2
    assert indices(store.get(["x"], 2, "t", timeout=0)) == [2, 3]


def test_counters_and_depth():
    store = SampleStore()
    put(store, group_rows(0, size=3), "prompt_ids", "response_ids")
    put(store, group_rows(0, size=3)[:1], "reward")
    assert store.depth(["response_ids"], "reward") == 3
    store.get(["response_ids"], 2, "reward", timeout=0, groups=False)
    assert store.depth(["response_ids"], "reward") == 1
    assert store.depth(["response_ids", "reward"], "train", groups=True) == 0
    stats = store.stats()
    assert stats["put"] == {"prompt_ids": 3, "response_ids": 3, "reward": 1}
    assert stats["got"] == {"reward": 2} and stats["rows"] == 3 and stats["groups"] == 1


def test_a_pickled_copy_keeps_rows_and_consumption_and_works():
    store = SampleStore()
    put(store, group_rows(0) + group_rows(1), "x")
    store.get(["x"], 1, "t", timeout=0)
    copy = pickle.loads(pickle.dumps(store))
    assert indices(copy.get(["x"], 2, "t", timeout=0)) == [2, 3]
    put(copy, group_rows(2), "x")
    assert copy.num_rows == 6 and store.num_rows == 4
    for sampler in (in_order, LengthBalanced("response_ids")):  # samplers travel too
        assert pickle.loads(pickle.dumps(sampler)) == sampler


# -- many threads at random ------------------------------------------------------------------

FIELDS = ("prompt_ids", "response_ids", "behaviour_logprobs")
TASKS = {"train": True, "train_dp": True, "audit": False}  # task -> groups


def _produce(store: SampleStore, groups: list[list[SampleRow]], rng: random.Random) -> None:
    """Write every field of these groups in random order and random chunks, prompt_ids first."""
    pending = [(r, f) for g in groups for r in g for f in FIELDS]
    rng.shuffle(pending)
    # keep each row's prompt_ids first: it is what creates the row in the pipeline
    pending.sort(key=lambda rf: rf[1] != "prompt_ids")
    while pending:
        chunk = pending[: rng.randint(1, 5)]
        pending = pending[len(chunk) :]
        for name in FIELDS:  # one put per field, of the chunk's rows that lack it
            rows = [row for row, f in chunk if f == name]
            store.put(rows, {name: [f"{name}{row.index}" for row in rows]})


def _reward_stage(store: SampleStore, rng: random.Random, done: list[int], total: int, lock):
    """A consumer that is also a producer: reads response_ids, writes reward, row by row."""
    while True:
        with lock:
            if done[0] >= total:
                return
        batch = store.get(["response_ids"], rng.randint(1, 4), "reward", 0.01, groups=False)
        for row, ids in zip(batch.rows, batch.data["response_ids"], strict=True):
            assert ids == f"response_ids{row.index}"
        store.put(batch.rows, {"reward": [f"reward{r.index}" for r in batch.rows]})
        with lock:
            done[0] += len(batch)


def _consume(store: SampleStore, task: str, groups: bool, rng: random.Random, seen: list):
    wanted = (*FIELDS, "reward")
    while True:
        try:
            batch = store.get(wanted, rng.randint(1, 3), task, rng.choice([0, 0.01]), groups=groups)
        except StoreClosed:
            return
        for name in wanted:
            assert batch.data[name] == [f"{name}{r.index}" for r in batch.rows]
        if groups:
            by_group: dict[int, list[SampleRow]] = {}
            for r in batch.rows:
                by_group.setdefault(r.group, []).append(r)
            for members in by_group.values():
                assert [r.index_in_group for r in members] == list(range(members[0].group_size))
        seen.extend(batch.rows)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_many_threads_at_random_see_every_row_exactly_once_per_task(seed):
    rng = random.Random(seed)
    groups, index = [], 0
    for g in range(60):
        size = rng.randint(1, 4)
        groups.append([SampleRow(index + i, g, i, size, 0, 0) for i in range(size)])
        index += size
    rows = [r for g in groups for r in g]
    store = SampleStore()
    errors: list[BaseException] = []
    seen: dict[str, list[SampleRow]] = {t: [] for t in TASKS}
    done, lock = [0], threading.Lock()

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as e:
                errors.append(e)
                store.close()

        return threading.Thread(target=run)

    producers = [
        guarded(_produce, store, groups[p::3], random.Random(seed * 10 + p)) for p in range(3)
    ]
    rewarders = [
        guarded(_reward_stage, store, random.Random(seed * 10 + 5 + w), done, len(rows), lock)
        for w in range(2)
    ]
    consumers = [
        guarded(_consume, store, t, groups_, random.Random(seed * 10 + 7 + c), seen[t])
        for c, (t, groups_) in enumerate([*TASKS.items(), ("train", True)])
    ]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that operations interleave
    try:
        for t in producers + rewarders + consumers:
            t.start()
        for t in producers + rewarders:
            t.join(30)
        store.close()
        for t in consumers:
            t.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for task, got in seen.items():
        assert sorted(r.index for r in got) == [r.index for r in rows], task
    assert store.stats()["got"]["reward"] == len(rows)


def internal_sizes(store: SampleStore) -> tuple[int, ...]:
    return tuple(map(len, (store._rows, store._groups, store._iterations, store._cleared)))


def test_memory_stays_bounded_over_a_long_run():
    store = SampleStore(remember_cleared=16)
    sizes = []
    index = 0
    for k in range(2000):
        batch = [SampleRow(index + i, k * 4 + i // 4, i % 4, 4, k, k) for i in range(16)]
        put(store, batch, "response_ids")
        index += 16
        if k >= 1:  # one iteration ahead, off-policy style
            got = store.get(["reward"], 4, "train", timeout=0, version=k, max_staleness=1)
            assert indices(got) == list(range(index - 32, index - 16))  # iteration k - 1
            sizes.append(internal_sizes(store))
            store.clear(k - 1)
        put(store, batch, "reward")
    # at most two iterations alive (16 rows, 4 groups each); 16 cleared iterations remembered
    assert max(sizes) == (32, 8, 2, 16) and internal_sizes(store) == (16, 4, 1, 16)
    stats = store.stats()
    assert stats["got"] == {"train": 1999 * 16} and len(stats["put"]) == 2


def test_min_size_wakes_as_soon_as_that_many_are_ready_and_returns_none_with_fewer():
    store = SampleStore()
    put(store, group_rows(0), "x")
    # a stage that scores what has arrived: 2 rows ready, it asked for up to 3, at least 1
    start = time.monotonic()
    assert indices(store.get(["x"], 3, "reward", timeout=5, groups=False, min_size=1)) == [0, 1]
    assert time.monotonic() - start < 1  # did not wait for the third
    # a consumer that takes two groups or nothing: one is ready, so nothing, and nothing taken
    assert len(store.get(["x"], 2, "sync", timeout=0.01, min_size=2)) == 0
    assert store.depth(["x"], "sync", groups=True) == 2
    put(store, group_rows(1), "x")
    assert indices(store.get(["x"], 2, "sync", timeout=0.01, min_size=2)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"min_size must be in 1\.\.batch_size"):
        store.get(["x"], 2, "t", timeout=0, min_size=3)


def test_iteration_limits_a_get_and_the_depth_to_that_iterations_rows():
    store = SampleStore()
    put(store, group_rows(0, iteration=0) + group_rows(1, iteration=1), "x")
    assert store.depth(["x"], "t", groups=True, iteration=0) == 2
    assert store.depth(["x"], "t", groups=True, units=True) == 2  # two groups in all
    assert indices(store.get(["x"], 2, "t", timeout=0, iteration=1)) == [2, 3]
    assert indices(store.get(["x"], 2, "t", timeout=0, groups=False, iteration=0)) == [0, 1]
    assert len(store.get(["x"], 2, "t", timeout=0, iteration=2)) == 0
