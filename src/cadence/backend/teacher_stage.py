"""The teacher stage (`distill.placement = "worker"`): teacher worker processes that score each
response's tokens with its task's teacher as rows reach the sample store, beside the reward
stage, so that the learner's processes hold no teacher and scoring overlaps generation and
training in every mode. The learner takes a group once every row has its `teacher_logprobs`.

A teacher worker loads its teachers (each directory once) before the run trains, so a broken
teacher fails first; one that raises or exits stops the run (store_stage.py). It computes no
advantage and knows no config. This module must not import transformers at import time.

Read on: docs/distillation.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cadence.backend.procs import Processes, Sender
from cadence.backend.store_stage import JobClock, StageWork, StoreStage, answer_messages
from cadence.dataplane import TEACH, TEACHER, TEACHER_LOGPROBS, Store
from cadence.metrics.trace import Tracer
from cadence.models.scoring import response_logprobs, teacher_key


@dataclass(frozen=True)
class TeacherSpec:
    """What a teacher worker builds itself from."""

    teachers: tuple[tuple[str, str], ...]  # (task, teacher directory); task "": every prompt
    dtype: str = "float32"
    device: str = "cpu"
    temperature: float = 1.0  # the sampling temperature the learner's log-probs divide by
    threads: int = 1
    rows_per_pass: int = 8


@dataclass
class TeacherResult:
    job: int
    logprobs: list[list[float]]  # per row, per response token
    start: float  # time.perf_counter() in the worker (comparable across processes)
    end: float


def load_teachers(spec: TeacherSpec) -> dict[str, torch.nn.Module]:
    """Task -> its teacher, frozen and in eval mode (each directory loaded once)."""
    from cadence.models import DTYPES, load_model

    loaded = {
        path: load_model(path, dtype=DTYPES[spec.dtype], device=spec.device)
        .requires_grad_(False)
        .eval()
        for path in dict.fromkeys(path for _, path in spec.teachers)
    }
    return {task: loaded[path] for task, path in spec.teachers}


def teach(spec: TeacherSpec, models: dict[str, torch.nn.Module], data: dict) -> list[list[float]]:
    """The `TEACHER_LOGPROBS` of a batch of rows (`TEACH` fields), each by its task's teacher."""
    keys = [teacher_key(models, prompt.task) for prompt in data["prompt"]]
    out: list[list[float]] = [[] for _ in keys]
    for key in dict.fromkeys(keys):
        rows = [i for i, k in enumerate(keys) if k == key]
        scored = response_logprobs(
            models[key],
            [data["prompt_ids"][i] for i in rows],
            [data["response_ids"][i] for i in rows],
            spec.temperature,
            spec.rows_per_pass,
        )
        for i, logprobs in zip(rows, scored, strict=True):
            out[i] = logprobs
    return out


def teacher_worker_main(wid: int, spec: TeacherSpec, inbox, results) -> None:
    """A teacher worker process: ('score', (job, data)) in, ('scored', wid, TeacherResult) out
    of `results`, the write end of its own pipe."""
    outbox = Sender(results)
    try:
        torch.set_num_threads(spec.threads)
        models = load_teachers(spec)
        outbox.put(("ready", wid, None))

        def answer(_kind: str, job: int, data) -> TeacherResult:
            start = time.perf_counter()
            logprobs = teach(spec, models, data)
            return TeacherResult(job, logprobs, start, time.perf_counter())

        answer_messages(wid, inbox, outbox, answer)
    except BaseException:
        outbox.report_error(wid)


class TeacherStage(StoreStage):
    """`num_workers` teacher worker processes (teachers loaded at construction) and the driver
    thread that feeds them rows from `store` (store_stage.py): `TEACH` in, `TEACHER_LOGPROBS`
    out."""

    def __init__(
        self,
        spec: TeacherSpec,
        num_workers: int,
        store: Store,
        tracer: Tracer,
        *,
        batch_size: int = 16,
        timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        work = StageWork(
            TEACHER,
            TEACH,
            lambda result: {TEACHER_LOGPROBS: result.logprobs},
            lambda _rows: timeout_s,
            JobClock("teacher worker", "pipeline.worker_timeout_s"),
            span="teach",
        )
        processes = Processes(
            "teacher worker", teacher_worker_main, lambda wid: (spec,), timeout_s, tag="teacher"
        )
        processes.start(num_workers)
        super().__init__(work, processes, store, tracer, batch_size)
