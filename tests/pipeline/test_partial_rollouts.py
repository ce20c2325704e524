"""Partial rollouts end to end (pipeline.partial_rollout): the proofs the other modes have.

- With no update mid-sequence a run equals `offpolicy` exactly (worker processes).
- With updates landing mid-sequence at a fixed decode step (thread workers, tests/partial_runs.py),
  every token the learner trains carries the version that sampled it, and its behaviour log-prob
  is the one the learner computes under that version's saved weights (recompute), or that
  version's weights give over the keys and values kept (keep), within 1e-5.
- Killed with SIGKILL mid-iteration and resumed, such a run ends with the uninterrupted run's
  parameters.
Ray equals local: tests/backend/test_ray.py.
"""

import os
import sys

import pytest
import torch

import cadence.builder.run as build
from cadence.builder import build_run, train
from cadence.engine import load_into
from cadence.metrics import MemorySink
from cadence.models import load_model
from cadence.pipeline.checkpoint_files import list_checkpoints
from inflight import kept_cache_logprobs, learner_logprobs
from partial_runs import PUBLISHED, publish_when_idle, thread_workers
from runs import UNFILTERED, Cadence, in_process, run_config, train_run

pytestmark = pytest.mark.slow

# One worker, one task of all six prompts per iteration, one version ahead: groups reach the
# learner in one order, and iteration k (k >= 1) is generated while the learner trains k - 1.
OFFPOLICY = (
    "pipeline.mode='offpolicy'",
    "pipeline.placement='separate'",
    "pipeline.num_workers=1",
    "pipeline.prompts_per_task=6",
    "pipeline.tasks_in_flight=1",
    "pipeline.max_staleness=1",
)
PARTIAL = "pipeline.partial_rollout=true"
PUBLISH_AT_STEP = 4  # of ten tokens at most: sequences are in flight


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _train(cfg, out, source_hook=None):
    """Build and train `cfg` (hooking its source first); (run, records, trained groups)."""
    run, sink, trained = build_run(cfg), MemorySink(), []
    if source_hook is not None:
        source_hook(run.source)
    groups = run.source.groups

    def recording():
        for g in groups():
            trained.append(g)
            yield g

    run.source.groups = recording
    train(run, out, extra_sinks=[sink], evaluate=False)
    return run, sink.records, trained


def test_without_an_update_mid_sequence_a_run_equals_offpolicy(model_dir, tmp_path):
    reference, ref_records, _ = train_run(run_config(model_dir, *OFFPOLICY), tmp_path / "ref")
    cfg = run_config(model_dir, *OFFPOLICY, PARTIAL)
    run, records, trained = _train(
        cfg, tmp_path / "partial", lambda source: publish_when_idle(source, 6)
    )
    assert [r["staleness_hist"] for r in records] == [[6, 0], [0, 6], [0, 6]]
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in ref_records]
    for key in ("trajectory_spans", "trajectory_staleness_worst", "tokens_by_version/1"):
        assert [r[key] for r in records] == [r[key] for r in ref_records], key
    assert all(r["trajectory_spans"] == 1.0 for r in records)
    assert all(len(set(c.token_versions)) <= 1 for g in trained for c in g.completions)
    final, ref = run.trainer.model.parameters(), reference.trainer.model.parameters()
    assert _max_diff(final, ref) <= 1e-6
    assert _max_diff(load_model(model_dir).parameters(), run.trainer.model.parameters()) > 1e-4


def _version_models(model_dir):
    """The weights published as each version, as models."""
    models = {}
    for v, tensors in PUBLISHED.items():
        models[v] = load_model(model_dir)
        load_into(models[v], tensors)
    return models


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_each_trained_token_has_the_logprob_of_its_recorded_version(
    model_dir, tmp_path, monkeypatch, kv
):
    monkeypatch.setattr(build, "make_pool", thread_workers(PUBLISH_AT_STEP))
    cfg = run_config(model_dir, *OFFPOLICY, PARTIAL, f"pipeline.partial_rollout_kv='{kv}'")
    run, records, trained = _train(cfg, tmp_path)
    assert [r["staleness_hist"] for r in records] == [[6, 0], [0, 6], [0, 6]]
    assert records[0]["trajectory_spans"] == 1.0
    for r in records[1:]:  # generated with k - 1 up to the update, then with k
        assert 1.0 < r["trajectory_spans"] <= 2.0 and r["trajectory_staleness_worst"] == 1
        assert r["tokens_by_version/0"] > 0 and r["tokens_by_version/1"] > 0
    assert all(r["dropped_groups"] == 0 for r in records)
    models, pad = _version_models(model_dir), run.tokenizer.pad_token_id
    temperature = cfg.rollout.temperature
    spanning = 0
    for g in trained:
        learner = {v: learner_logprobs(models[v], g, pad, temperature) for v in models}
        for i, c in enumerate(g.completions):
            stamps = torch.tensor(c.token_versions)  # (T,)
            stored = torch.tensor(c.logprobs)  # (T,)
            by_version = torch.stack([learner[int(v)][i][t] for t, v in enumerate(stamps)])
            spanning += len(set(c.token_versions)) == 2
            if kv == "recompute":
                torch.testing.assert_close(stored, by_version, atol=1e-5, rtol=0)
                continue
            first = stamps == stamps[0]  # before the update: the learner's under that version
            torch.testing.assert_close(stored[first], by_version[first], atol=1e-5, rtol=0)
            kept = kept_cache_logprobs(
                models, g.prompt_ids, c.token_ids, c.token_versions, temperature
            )
            torch.testing.assert_close(stored, kept, atol=1e-5, rtol=0)
    assert spanning >= 40  # of the 48 sequences of iterations 1 and 2: those not ended by step 4


def test_a_run_killed_mid_iteration_resumes_to_the_same_parameters(
    model_dir, tmp_path, monkeypatch
):
    sets = [
        "train",
        "configs/default.toml",
        *(
            a
            for s in (
                f"model.path='{model_dir}'",
                *OFFPOLICY,
                PARTIAL,
                "pipeline.prompts_per_task=4",
                "pipeline.partial_rollout_kv='recompute'",
                "train.iterations=5",
                "train.prompts_per_iteration=4",
                "train.micro_batch_groups=2",
                "train.lr=1e-3",
                "train.checkpoint_every=2",
                "train.keep_checkpoints=1",
                "rollout.group_size=4",
                "rollout.max_new_tokens=10",
                "data.num_heldout=4",
                "algo.kl_coef=0.05",
                "metrics.progress=false",
                "reward.function='fixtures_rewards:kill_learner_once'",
                UNFILTERED,  # 16 reward calls an iteration, as counted
            )
            for a in ("--set", s)
        ),
    ]
    kill_at = str(4 + 3 * 16 + 8)  # held-out 4, then 16 an iteration: in iteration 3
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(sys.path),
        "CADENCE_TEST_KILL_AT": kill_at,
        "CADENCE_TEST_PUBLISH_AT_STEP": str(PUBLISH_AT_STEP),
    }
    marker, never = tmp_path / "killed", tmp_path / "never-killed"
    full, killed = tmp_path / "full", tmp_path / "killed-run"
    # Only the run killed with SIGKILL is a process of its own (`python -m partial_runs`); the
    # uninterrupted run (trained meanwhile) and the resumed one run here, as `cadence` with the
    # same thread workers, and find their marker taken: they kill nothing.
    never.touch()
    monkeypatch.setattr(build, "make_pool", thread_workers(PUBLISH_AT_STEP))
    monkeypatch.setenv("CADENCE_TEST_KILL_AT", kill_at)
    monkeypatch.setenv("CADENCE_TEST_KILL_MARKER", str(never))
    proc = Cadence(
        [*sets, "--out", str(killed)], env, marker, tmp_path / "killed.err", "partial_runs"
    )
    try:
        assert in_process([*sets, "--out", str(full)]) == 0
        assert proc.wait(timeout=300) == -9, proc.stderr()  # SIGKILL, in iteration 3
    except BaseException:
        proc.stop()
        raise
    assert [p.name for p in list_checkpoints(killed)] == ["iter-000002"]
    assert in_process(["train", "--resume", str(killed)]) == 0
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5  # each iteration once
    a, b = load_model(full / "final"), load_model(killed / "final")
    assert _max_diff(a.parameters(), b.parameters()) <= 1e-6
    assert _max_diff(a.parameters(), load_model(model_dir).parameters()) > 1e-4
