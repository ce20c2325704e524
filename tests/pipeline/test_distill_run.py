"""On-policy distillation in whole runs: a teacher's reverse KL is reported, periodic makes
sync's distilled update with the teacher in the learner or in a stage of its own, and a teacher
of another tokenizer is refused before any weight loads (docs/distillation.md)."""

from __future__ import annotations

import json
import shutil

import pytest

from cadence.builder import build_run
from cadence.config import ConfigError
from cadence.data import ArithmeticTask
from cadence.models import init_model, load_model, load_tokenizer
from cadence.models.io import save_pretrained
from runs import TWO_WORKERS, run_config, train_run
from tiny_models import perturbed
from updates import assert_same_update

DISTILL = ("algo.kl_coef=0.0", "distill.coef=1.0", "distill.reward_coef=0.0")


@pytest.fixture(scope="module")
def teacher_dir(model_dir, tmp_path_factory):
    """The test model's shape and tokenizer, other weights (noise of a seed added)."""
    out = tmp_path_factory.mktemp("teacher")
    save_pretrained(perturbed(load_model(model_dir), 7, 0.1), load_tokenizer(model_dir), out)
    return out


def _cfg(model_dir, teacher_dir, mode, *extra):
    return run_config(
        model_dir,
        f"pipeline.mode='{mode}'",
        "pipeline.placement='separate'",
        *TWO_WORKERS,
        *DISTILL,
        f"distill.teacher='{teacher_dir}'",
        *extra,
    )


@pytest.mark.slow
def test_periodic_makes_the_distilled_sync_update_and_reports_the_teacher_gap(
    model_dir, teacher_dir, tmp_path
):
    sync_grads: list = []
    sync = train_run(_cfg(model_dir, teacher_dir, "sync"), tmp_path / "sync", sync_grads)
    kls = [r["distill_reverse_kl"] for r in sync.records]
    assert all(k > 0.05 for k in kls)  # the teacher differs: the signal is not trivially 0
    summary = json.loads((tmp_path / "sync" / "summary.json").read_text())
    assert summary["distill_reverse_kl_last"] == pytest.approx(kls[-1])
    per_grads: list = []
    per = train_run(_cfg(model_dir, teacher_dir, "periodic"), tmp_path / "per", per_grads)
    assert [r["distill_reverse_kl"] for r in per.records] == pytest.approx(kls, rel=1e-4)
    assert_same_update(
        per.run.trainer.model, sync.run.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    # the teacher in a stage of its own: the learner holds none, the rows come scored
    staged_grads: list = []
    worker = "distill.placement='worker'"
    staged = train_run(
        _cfg(model_dir, teacher_dir, "periodic", worker), tmp_path / "st", staged_grads
    )
    assert staged.run.trainer.forward.teachers.staged
    assert [r["distill_reverse_kl"] for r in staged.records] == pytest.approx(kls, rel=1e-4)
    assert all(r["stage_teacher_rows_per_s"] > 0 for r in staged.records)
    # its log-probs come from passes of another shape (a worker's padded rows, not the
    # learner's layout): equal within 1e-5 a token (test_distill.py), and Adam magnifies that
    # in the entries it steps ill-conditioned, so the later steps' gradients agree less closely
    assert_same_update(
        staged.run.trainer.model, sync.run.trainer.model, staged_grads, sync_grads,
        grad_rtol=3e-4, param_atol=5e-6,
    )  # fmt: skip


def test_a_teacher_of_another_tokenizer_is_refused_before_any_weight_loads(model_dir, tmp_path):
    other = tmp_path / "other"
    corpus = ArithmeticTask(difficulty=3, seed=5).corpus(300)  # another BPE vocabulary
    init_model("test", other, corpus, seed=1)
    (other / "model.safetensors").unlink()  # loading any weight would fail otherwise
    cfg = run_config(model_dir, *DISTILL, f"distill.teacher='{other}'")
    with pytest.raises(ConfigError, match="does not share the student's tokenizer"):
        build_run(cfg)
    shutil.rmtree(other)


def test_a_loss_that_reads_one_advantage_per_sequence_is_refused(model_dir, teacher_dir):
    cfg = run_config(model_dir, *DISTILL, f"distill.teacher='{teacher_dir}'", "algo.loss='gspo'")
    with pytest.raises(ConfigError, match="reads one per sequence"):
        build_run(cfg)


@pytest.mark.slow
def test_an_offpolicy_run_of_a_lora_student_distils_stale_rows_too(
    model_dir, teacher_dir, tmp_path
):
    cfg = _cfg(
        model_dir,
        teacher_dir,
        "offpolicy",
        "pipeline.max_staleness=1",
        "model.lora.r=4",
        "model.lora.alpha=8.0",
        "distill.reward_coef=1.0",
    )
    trained = train_run(cfg, tmp_path / "run")
    assert all(r["distill_reverse_kl"] > 0.05 for r in trained.records)
    assert max(r["staleness_max"] for r in trained.records) == 1  # stale rows were distilled
