"""Reward functions for tests, loaded by import path like a user's own (`module:function`)."""


def even_length(prompt: str, completion: str, answer: str) -> float:
    """1 for a completion of even length: gives an untrained model's groups a spread of rewards."""
    return 1.0 if len(completion) % 2 == 0 else 0.0


def exit_on_third_call(prompt: str, completion: str, answer: str) -> float:
    """Kills the worker process that calls it the third time: a worker dying mid-iteration.

    In any other process (the learner evaluates with the same reward) it is a constant 0.
    """
    import multiprocessing
    import os

    global _calls
    if multiprocessing.current_process().name.startswith("cadence-worker"):
        _calls += 1
        if _calls == 3:
            os._exit(3)
    return 0.0


_calls = 0


def exit_once(prompt: str, completion: str, answer: str) -> float:
    """`even_length`, except that the first worker process to score its 15th sample exits (code
    3), mid-iteration, once per run: the file named by $CADENCE_TEST_EXIT_ONCE marks that it
    happened, so the replacement worker and the others carry on."""
    import multiprocessing
    import os

    global _calls
    if multiprocessing.current_process().name.startswith("cadence-worker"):
        _calls += 1
        if _calls == 15:
            try:
                os.close(os.open(os.environ["CADENCE_TEST_EXIT_ONCE"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(3)
    return even_length(prompt, completion, answer)


def _learner_of(server: int) -> int:
    """The process that started the fork server `server` (backend/procs.py): the learner."""
    from pathlib import Path

    return int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])


def kill_learner_once(prompt: str, completion: str, answer: str) -> float:
    """`even_length`, except that the process scoring its $CADENCE_TEST_KILL_AT-th sample sends
    SIGKILL to the learner (itself when colocated; in a worker, the parent of the fork server
    that forked it): a crash in the middle of an iteration, once, marked by the file
    $CADENCE_TEST_KILL_MARKER."""
    import multiprocessing
    import os
    import signal

    global _calls
    _calls += 1
    if _calls == int(os.environ["CADENCE_TEST_KILL_AT"]):
        try:
            os.close(os.open(os.environ["CADENCE_TEST_KILL_MARKER"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            in_worker = multiprocessing.current_process().name.startswith("cadence-worker")
            os.kill(_learner_of(os.getppid()) if in_worker else os.getpid(), signal.SIGKILL)
    return even_length(prompt, completion, answer)


def flaky(prompt: str, completion: str, answer: str) -> float:
    """Raises on a third of completions (by length), NaN on another third, else `even_length`."""
    if len(completion) % 3 == 0:
        raise ValueError("flaky reward: cannot score this one")
    if len(completion) % 3 == 1:
        return float("nan")
    return even_length(prompt, completion, answer)


def exit_in_reward_worker(prompt: str, completion: str, answer: str) -> float:
    """Kills the reward worker process that calls it the third time; elsewhere a constant 0."""
    import multiprocessing
    import os

    global _calls
    if multiprocessing.current_process().name.startswith("cadence-reward"):
        _calls += 1
        if _calls == 3:
            os._exit(3)
    return 0.0


def hang_on_odd_length(prompt: str, completion: str, answer: str) -> float:
    """Never returns for a completion of odd length (a reward call that hangs); else 1."""
    import threading

    if len(completion) % 2:
        threading.Event().wait()
    return 1.0


def always_raises(prompt: str, completion: str, answer: str) -> float:
    """A reward that cannot score anything."""
    raise RuntimeError("the grader is down")


def always_one(prompt: str, completion: str, answer: str) -> float:
    """The same reward for every completion: no group has a learning signal."""
    return 1.0


def _jitter_s(completion: str) -> float:
    import zlib

    return zlib.crc32(completion.encode()) % 20 / 1000  # 0-19 ms, the same for the same text


def jittery_even_length(prompt: str, completion: str, answer: str) -> float:
    """`even_length` after a wait of 0-19 ms set by the completion: calls in flight together
    finish out of order, as a remote grader's would."""
    import time

    time.sleep(_jitter_s(completion))
    return even_length(prompt, completion, answer)


async def async_jittery_even_length(prompt: str, completion: str, answer: str) -> float:
    """`jittery_even_length` as an `async def` reward."""
    import asyncio

    await asyncio.sleep(_jitter_s(completion))
    return even_length(prompt, completion, answer)


def half_second_even_length(prompt: str, completion: str, answer: str) -> float:
    """`even_length` after 0.5 s: a reward that waits (a judge, a sandbox)."""
    import time

    time.sleep(0.5)
    return even_length(prompt, completion, answer)


def digit_share(prompt: str, completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits (0 when empty): a dense signal
    an untrained model's samples spread over, for the learning tests."""
    text = completion.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def letter_share(prompt: str, completion: str, answer: str) -> float:
    """The share of the completion's characters that are lowercase ASCII letters: a dense signal
    an untrained model's samples spread over (about 0.4 at the start), for the learning tests."""
    return sum("a" <= ch <= "z" for ch in completion) / len(completion) if completion else 0.0


def called_calculator(prompt: str, completion: str, answer: str) -> float:
    """1 for an episode in which a calculator call gave a result, not an error: what the tool
    environment's learning test raises."""
    return 1.0 if "<result>" in completion and "<result>error" not in completion else 0.0


def letters_after_a_result(prompt: str, completion: str, answer: str) -> float:
    """The share of lowercase letters in what the policy wrote after its last tool result (0
    without one): dense, and only an episode of two turns or more can score, for the tool
    environment's learning test."""
    if "</result>" not in completion:
        return 0.0
    return letter_share(prompt, completion.rsplit("</result>", 1)[1], answer)
