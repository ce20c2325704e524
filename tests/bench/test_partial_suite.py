"""`cadence bench --suite partial` and `cadence study offpolicy --variants`: which runs they make
and with which keys (the runs themselves are replaced: their code is tested elsewhere)."""

import json

import pytest

import cadence.bench.modes as modes
import cadence.study.offpolicy as study
from cadence.config import load_config


def test_the_partial_modes_differ_from_offpolicy_by_their_keys_only(monkeypatch, tmp_path):
    seen = {}

    def build_run(cfg):
        return cfg

    def train(cfg, out, evaluate):
        seen[out.name] = cfg
        return {
            "tpspd_overall": 2.0,
            "wall_s": 10.0,
            "gen_s": 4.0,
            "train_s": 8.0,
            "pipeline_efficiency": 0.9,
        }

    monkeypatch.setattr("cadence.builder.build_run", build_run)
    monkeypatch.setattr("cadence.builder.train", train)
    names = modes.parse_modes(modes.PARTIAL_SUITE + ",partial-recompute")
    rows = modes.bench("configs/bench-longtail.toml", [], names, 1, tmp_path)
    off, keep, recompute = seen["offpolicy-0"], seen["partial-0"], seen["partial-recompute-0"]
    assert not off.pipeline.partial_rollout
    assert keep.pipeline.partial_rollout and keep.pipeline.partial_rollout_kv == "keep"
    assert recompute.pipeline.partial_rollout_kv == "recompute"
    assert keep.pipeline.mode == off.pipeline.mode == "offpolicy"
    assert keep.model_copy(update={"pipeline": off.pipeline}) == off  # nothing else differs
    assert [r["learner_idle"] for r in rows] == pytest.approx([0.2] * len(rows))
    table = (tmp_path / "bench.md").read_text()
    assert "| x offpolicy |" in table and "| partial | offpolicy | separate | 2 |" in table


def test_study_variants_run_partial_rows_for_off_policy_cells_only(monkeypatch, tmp_path):
    made = []

    def run_cell(config, overrides, loss, n, out, variant="plain"):
        load_config(
            "configs/study-offpolicy.toml", [*overrides, *study.cell_overrides(loss, n, variant)]
        )
        made.append((loss, n, variant))
        return {
            "loss": loss,
            "staleness": n,
            "variant": variant,
            "accuracy": 0.5,
            "accuracy_se": 0.05,
            "reward": 0.4,
            "kl": 0.1 * n,
            "tpspd": 1.0,
        }

    monkeypatch.setattr(study, "run_cell", run_cell)
    variants = ("plain", "partial", "partial-corrected")
    study.study_offpolicy(None, [], ["grpo"], [0, 1], tmp_path, variants)
    assert made == [("grpo", 0, "plain"), *[("grpo", 1, v) for v in variants]]
    again = study.study_offpolicy(None, [], ["grpo"], [0, 1], tmp_path, variants)  # resumes
    assert len(made) == 4 and len(again) == 4
    assert [r["variant"] for r in json.loads((tmp_path / "study.json").read_text())] == [
        "plain",
        "plain",
        "partial",
        "partial-corrected",
    ]
    assert "| grpo | 1 | partial-corrected | 0.500 ± 0.050 |" in (tmp_path / "study.md").read_text()
