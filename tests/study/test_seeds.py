"""`cadence study seeds`: one run per seed on one held-out set, a table, a plot, and resumption."""

import json
import math

import pytest

from cadence.cli import main
from cadence.study import seeds as seeds_module
from cadence.study import study_seeds
from runs import UNFILTERED

pytestmark = pytest.mark.slow


def _overrides(model_dir):
    return [
        f"model.path='{model_dir}'",
        "train.iterations=2",
        "train.prompts_per_iteration=4",
        "train.eval_every=1",
        "train.checkpoint_every=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "data.num_heldout=6",
        "train.lr=1e-3",
        "reward.function='fixtures_rewards:even_length'",
        UNFILTERED,
    ]


def test_each_seed_is_measured_on_the_same_problems_and_the_study_resumes(
    model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "study"
    rows = study_seeds("configs/default.toml", _overrides(model_dir), [0, 1], out)
    assert [r["seed"] for r in rows] == [0, 1]
    # one held-out set (data.seed): the same starting model scores the same on it
    assert rows[0]["accuracy_before"] == rows[1]["accuracy_before"]
    for r in rows:
        p = r["accuracy_after"]
        assert math.isclose(r["accuracy_after_stderr"], math.sqrt(p * (1 - p) / 6))
        assert math.isclose(r["gain"], r["accuracy_after"] - r["accuracy_before"])
        assert [x for x, _ in r["curve"]] == [0, 1, 2]  # before, after iteration 1, after 2
    table = (out / "study.md").read_text()
    assert "| 0 |" in table and "| 1 |" in table and "mean ± std" in table
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "study.json").read_text()) == rows

    # seeds done are kept; a run an interruption left unfinished goes on from its checkpoint
    (out / "runs" / "seed-1" / "summary.json").unlink()
    ran = []
    real = seeds_module.train_or_resume
    monkeypatch.setattr(
        seeds_module, "train_or_resume", lambda c, o, d: ran.append(d.name) or real(c, o, d)
    )
    more = study_seeds("configs/default.toml", _overrides(model_dir), [0, 2], out)
    assert ran == ["seed-2"] and [r["seed"] for r in more] == [0, 2]
    assert seeds_module.train_or_resume is not real
    overrides = [*_overrides(model_dir), "train.iterations=3", "train.seed=1"]
    real("configs/default.toml", overrides, out / "runs" / "seed-1")
    lines = (out / "runs" / "seed-1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2]  # resumed, none twice

    # a run that finished before its row was recorded is read back, not trained again
    rows_now = json.loads((out / "study.json").read_text())
    (out / "study.json").write_text(json.dumps([r for r in rows_now if r["seed"] != 2]))
    before = (out / "runs" / "seed-2" / "metrics.jsonl").read_bytes()
    again = study_seeds("configs/default.toml", _overrides(model_dir), [2], out)
    assert [r["seed"] for r in again] == [2] and again[0]["gain"] == more[1]["gain"]
    assert (out / "runs" / "seed-2" / "metrics.jsonl").read_bytes() == before


def test_cli_study_seeds_rejects_a_bad_seed_list(capsys):
    assert main(["study", "seeds", "--seeds", "a,b", "--out", "/nonexistent"]) == 2
    assert "cadence study" in capsys.readouterr().err
