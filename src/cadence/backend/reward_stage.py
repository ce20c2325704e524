"""The reward stage: reward worker processes that score responses as they reach the sample store.

Failure is loud, as with rollout workers: a reward worker that cannot build its scorer, raises
while scoring or exits makes the driver stop with `WorkerError` (with the worker's traceback) or
`WorkerDied`, close the store (which wakes the learner, who re-raises it) and leave no process.
A dead reward worker is not replaced. This module must not import transformers at import time.

Read on: docs/pipeline.md#the-sample-store-and-the-reward-stage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from cadence.backend.procs import Processes, Sender
from cadence.backend.store_stage import JobClock, StageWork, StoreStage, answer_messages
from cadence.dataplane import SCORER, Store
from cadence.metrics.trace import Tracer
from cadence.rewards import RewardSpec, build_batch_scorer


@dataclass
class ScoreResult:
    job: int
    rewards: list[float]
    errors: list[str | None]
    start: float  # time.perf_counter() in the worker (comparable across processes)
    end: float


# what may make a reward worker's message take longer than pipeline.worker_timeout_s
REWARD_LIMIT = (
    "pipeline.worker_timeout_s, or the calls' own worst case: reward.timeout_s per call, "
    "reward.concurrency at a time"
)
GRACE_S = 60.0  # beyond the calls' own worst case: starting, scheduling, the reply's trip


def work_limit_s(spec: RewardSpec, num_calls: int, floor_s: float) -> float:
    """How long a reward worker may take over a message of `num_calls` calls before it is
    taken for hung: `floor_s` (pipeline.worker_timeout_s), or where longer the message's own
    worst case, every call running to its deadline (reward.timeout_s), reward.concurrency at a
    time (one where unset: a reward's own default is never more parallel than the key), plus
    `GRACE_S`. 32 calls of 10 s one at a time may take 320 s: a fixed 300 s failed them."""
    if spec.kind != "rule" or spec.timeout_s <= 0:  # no deadline per call to derive one from
        return floor_s
    waves = math.ceil(num_calls / max(spec.concurrency or 1, 1))
    return max(floor_s, waves * spec.timeout_s + GRACE_S)


def reward_worker_main(wid: int, spec: RewardSpec, inbox, results) -> None:
    """A reward worker process: ('score', (job, data)) or, rule rewards only, ('calls', (job,
    reward calls)) in, ('scored', wid, ScoreResult) out of `results`, the write end of its own
    pipe."""
    outbox = Sender(results)
    try:
        torch.set_num_threads(spec.threads)
        scorer = build_batch_scorer(spec)
        outbox.put(("ready", wid, None))

        def answer(kind: str, job: int, data) -> ScoreResult:
            start = time.perf_counter()
            # "calls": a rollout worker's reward calls (reward_procs.py); "score": store rows
            rewards, errors = scorer.score_calls(data) if kind == "calls" else scorer(data)
            return ScoreResult(job, rewards, errors, start, time.perf_counter())

        answer_messages(wid, inbox, outbox, answer)
    except BaseException:
        outbox.report_error(wid)


class RewardStage(StoreStage):
    """`num_workers` reward worker processes and the driver thread that feeds them from `store`
    (store_stage.py): the rows' responses in, `reward` and `reward_error` out.

    Built (processes started, scorers loaded) at construction, so a broken reward fails before
    training starts; `start()` starts the driver; `failure` holds what stopped it.
    """

    def __init__(
        self,
        spec: RewardSpec,
        num_workers: int,
        store: Store,
        tracer: Tracer,
        *,
        batch_size: int = 32,
        timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        work = StageWork(
            SCORER,
            tuple(spec.fields),
            lambda r: {"reward": r.rewards, "reward_error": r.errors},
            lambda calls: work_limit_s(spec, calls, timeout_s),
            JobClock("reward worker", REWARD_LIMIT),
        )
        processes = Processes(
            "reward worker", reward_worker_main, lambda wid: (spec,), timeout_s, tag="reward"
        )
        processes.start(num_workers)
        super().__init__(work, processes, store, tracer, batch_size)

    @property
    def rows_scored(self) -> int:
        return self.rows_done
