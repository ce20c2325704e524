"""Rank processes (`backend.ranks.LocalRanks`): calls answered in order, a failing or killed
rank named with its traceback or exit code, nothing left running."""

import multiprocessing
import os
import signal
import time

import pytest

from cadence.backend import WorkerDied, WorkerError
from cadence.backend.ranks import LocalRanks
from fixtures_ranks import EchoRank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start(num_ranks: int = 2) -> LocalRanks:
    ranks = LocalRanks(EchoRank, num_ranks, spawn_args=lambda r: (f"hello {r}",), timeout_s=120)
    for r in range(num_ranks):
        ranks.call(r, "build")
    assert ranks.wait() == [[None]] * num_ranks
    return ranks


@pytest.fixture(scope="module")
def shared_ranks():
    ranks = _start()
    yield ranks
    ranks.close()


@pytest.fixture
def ranks():
    ranks = _start()
    yield ranks
    ranks.close()


def test_calls_are_answered_in_order_per_rank(shared_ranks):
    ranks = shared_ranks
    for value in range(4):
        for r in range(2):
            ranks.call(r, "echo", value)
    replies = ranks.wait()
    assert [[v for _, v, _, _ in rank] for rank in replies] == [[0, 1, 2, 3]] * 2
    assert [rank[0][2] for rank in replies] == ["hello 0", "hello 1"]
    assert [rank[0][3] for rank in replies] == ranks.pids
    ranks.poll()  # nothing due, nothing wrong
    assert ranks.wait() == [[], []]


def test_a_rank_that_raises_is_named_with_its_traceback(ranks):
    pids = ranks.pids
    ranks.call(1, "fail", "no")
    with pytest.raises(WorkerError, match=r"(?s)learner rank 1 failed:\n.*Traceback.*refuses: no"):
        ranks.wait()
    ranks.close()
    assert not any(_alive(p) for p in pids)
    assert not {c.pid for c in multiprocessing.active_children()} & set(pids)


def test_a_killed_rank_is_named_within_seconds(ranks):
    pids = ranks.pids
    for r in range(2):
        ranks.call(r, "sleep", 30 if r == 1 else 0.0)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"learner rank 1 \(pid \d+\) exited with code -9") as e:
        ranks.wait()
    assert e.value.wid == 1 and time.monotonic() - start < 10
    ranks.close()
    assert not any(_alive(p) for p in pids)
    assert not {c.pid for c in multiprocessing.active_children()} & set(pids)


def test_a_wait_that_outlasts_its_timeout_names_the_ranks_and_calls(shared_ranks):
    ranks = shared_ranks
    ranks.call(0, "sleep", 3.0)
    with pytest.raises(
        TimeoutError, match=r"learner ranks did not answer within 1s: \{0: \['sleep'\]\}"
    ):
        ranks.wait(timeout_s=1.0)
    assert ranks.wait() == [[None], []]  # the late reply is still taken in order


def test_a_wait_measures_silence_not_the_work_queued(shared_ranks):
    # Before: one deadline for every reply due from the start of the wait, so four queued 1-s
    # calls under a 2.5-s limit timed out after two replies though nothing hung.
    ranks = shared_ranks
    for _ in range(4):
        ranks.call(0, "sleep", 1.0)
    start = time.monotonic()
    assert ranks.wait(timeout_s=2.5) == [[None] * 4, []]
    assert time.monotonic() - start >= 4.0  # longer than the limit: it is not a total


def test_a_hung_rank_is_named_while_a_busy_one_is_not(shared_ranks):
    ranks = shared_ranks
    for _ in range(4):
        ranks.call(0, "sleep", 1.0)  # busy for 4 s, never silent for 2.5
    ranks.call(1, "sleep", 5.0)  # silent past the limit: hung, as far as 2.5 s can tell
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"learner ranks did not answer within 2.5s: \{1: \['sleep'\]\}$"
    ):
        ranks.wait(timeout_s=2.5)
    assert 2.5 <= time.monotonic() - start < 4.0  # named at the limit, not after rank 0's work
    assert ranks.wait() == [[None] * 4, [None]]  # the late replies are still taken in order
