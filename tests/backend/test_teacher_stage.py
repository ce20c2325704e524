"""The teacher stage (`distill.placement = "worker"`): teacher workers score each row with its
task's teacher as rows reach the sample store, as the learner's own teacher pass would; a
teacher that cannot load stops the run before it trains, one that dies stops it with its exit.
"""

import multiprocessing
import shutil
import time

import pytest

from cadence.backend import WorkerDied, WorkerError
from cadence.backend.teacher_stage import TeacherSpec, TeacherStage
from cadence.dataplane import (
    LEARNER,
    TEACHER_LOGPROBS,
    TRAIN,
    SampleStore,
    batch_groups,
    group_rows,
)
from cadence.metrics import Tracer
from cadence.models import load_model, load_tokenizer, save_pretrained
from cadence.models.scoring import response_logprobs
from cadence.types import Completion, Group, Prompt
from tiny_models import perturbed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def other_dir(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("other")
    save_pretrained(perturbed(load_model(model_dir), 5, 0.1), load_tokenizer(model_dir), out)
    return out


def _groups() -> list[Group]:
    groups = []
    for g in range(4):
        prompt = Prompt(f"p{g}", "", "", task="ab"[g % 2])
        completions = [Completion([5 + g, 9 + j, 3][: 1 + j], [0.0] * (1 + j)) for j in range(3)]
        groups.append(Group(prompt, [1, 7, 2 + g], completions, 0, 0))
    return groups


def test_each_row_is_scored_by_its_task_s_teacher_as_the_learner_would(model_dir, other_dir):
    spec = TeacherSpec((("a", str(other_dir)), ("b", str(model_dir))), temperature=0.8)
    store, tracer = SampleStore(), Tracer()
    stage = TeacherStage(spec, 2, store, tracer, batch_size=4)
    groups = _groups()
    try:
        stage.start()
        for g, group in enumerate(groups):
            store.put(*group_rows(group, g, 3 * g, scored=True))
        batch = store.get((*TRAIN, TEACHER_LOGPROBS), 4, LEARNER, timeout=120, min_size=4)
    finally:
        stage.close()
    assert not multiprocessing.active_children()
    teachers = {"a": load_model(other_dir).eval(), "b": load_model(model_dir).eval()}
    for group in batch_groups(batch):
        want = response_logprobs(
            teachers[group.prompt.task],
            [group.prompt_ids] * 3,
            [c.token_ids for c in group.completions],
            temperature=0.8,
        )
        got = [c.teacher_logprobs for c in group.completions]
        for row, expected in zip(got, want, strict=True):
            assert row == pytest.approx(expected, abs=1e-5)
    assert stage.rows_done == 12
    spans = [s for s in tracer.spans if s.name == "teach"]
    assert spans and {s.track for s in spans} <= {"teacher-0", "teacher-1"}


def test_a_teacher_that_cannot_load_fails_before_anything_runs(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(WorkerError, match="teacher worker"):
        TeacherStage(TeacherSpec((("", str(broken)),)), 1, SampleStore(), Tracer())
    assert not multiprocessing.active_children()


def test_a_teacher_worker_that_dies_stops_the_stage_with_its_exit(model_dir):
    store = SampleStore()
    stage = TeacherStage(TeacherSpec((("", str(model_dir)),)), 1, store, Tracer())
    try:
        stage.processes.procs[0].process.kill()
        stage.start()
        store.put(*group_rows(_groups()[0], 0, 0, scored=True))
        deadline = time.monotonic() + 60
        while stage.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stage.close()
    assert isinstance(stage.failure, WorkerDied) and "teacher worker 0" in str(stage.failure)
    assert not multiprocessing.active_children()
