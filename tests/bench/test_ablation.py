"""The ablation suite: the grid's cells, their ratios, the three outputs, and bad input."""

import json

import pytest

from cadence.bench import ablation, trl_setup
from cadence.bench.common import interleave, median_row
from cadence.cli import main

CELLS = [
    "sync-colocated/share/reuse",
    "sync-colocated/noshare/noreuse",
    "periodic/share/reuse",
    "trl",
]


def cli_args(model_dir, out, *extra):
    args = ["bench", "--suite", "ablation", "--repeats", "1", "--iterations", "1"]
    args += ["--out", str(out)]
    for o in [
        f"model.path='{model_dir}'",
        "train.prompts_per_iteration=4",
        "train.micro_batch_groups=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "algo.kl_coef=0.05",
        "reward.function='fixtures_rewards:even_length'",
    ]:
        args += ["--set", o]
    return [*args, *extra]


@pytest.mark.slow
def test_reduced_grid_writes_json_markdown_and_png(model_dir, tmp_path):
    assert main(cli_args(model_dir, tmp_path, "--cells", ",".join(CELLS))) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["name"]: r for r in report["cells"]}
    assert [r["name"] for r in report["cells"]] == CELLS
    for r in rows.values():
        assert r["tpspd"] > 0 and r["wall_s"] > 0 and r["num_tokens"] > 0, r["name"]
        assert r["repeats"] == 1 and len(r["tpspd_all"]) == 1
    assert rows["trl"]["x_trl"] == 1.0
    assert rows["sync-colocated/share/reuse"]["x_sync_colocated"] == 1.0
    assert rows["sync-colocated/noshare/noreuse"]["x_no_savings"] == 1.0
    assert rows["periodic/share/reuse"]["placement"] == "separate"
    # the cells' overrides took effect: policy + reference passes, plus the frozen old copy's when
    # reuse is off; sharing the prompt computes fewer tokens than were trained
    on, off = rows["sync-colocated/share/reuse"], rows["sync-colocated/noshare/noreuse"]
    assert on["forward_passes_per_microbatch"] == 2 and off["forward_passes_per_microbatch"] == 3
    assert on["tokens_computed"] < on["num_tokens"] == off["tokens_computed"]
    assert report["grpo_config"]["beta"] == 0.05 and report["trl_available"] is True
    md = (tmp_path / "bench.md").read_text()
    for name in CELLS:
        assert f"| {name} |" in md
    assert "x TRL" in md and "idle s" in md and "periodic/share/reuse is" in md
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_full_grid_is_three_pipelines_by_two_by_two_plus_offpolicy_and_trl():
    grid = ablation.default_cells(offpolicy=True, trl=True)
    assert len(grid) == 3 * 2 * 2 + 2 and len(set(grid)) == len(grid)
    assert grid[-2:] == ["offpolicy-1/share/reuse", "trl"]
    assert "sync/noshare/reuse" in grid and "periodic/share/noreuse" in grid
    assert ablation.default_cells(offpolicy=False, trl=False) == grid[:-2]
    assert ablation.cell_overrides("periodic/noshare/reuse") == [
        "pipeline.mode='periodic'",
        "pipeline.placement='separate'",
        "learner.shared_prompt=false",
        "learner.reuse_old_logprobs=true",
    ]


def test_ratios_are_against_trl_sync_colocated_with_the_same_savings_and_no_savings():
    rows = [
        {"name": "sync-colocated/share/reuse", "tpspd": 300.0},
        {"name": "sync-colocated/noshare/noreuse", "tpspd": 100.0},
        {"name": "periodic/share/reuse", "tpspd": 450.0},
        {"name": "periodic/noshare/noreuse", "tpspd": 150.0},
        {"name": "trl", "tpspd": 150.0},
    ]
    ablation.add_ratios(rows)
    r = {x["name"]: x for x in rows}
    assert r["periodic/share/reuse"]["x_trl"] == 3.0
    assert r["periodic/share/reuse"]["x_sync_colocated"] == 1.5  # 450 / 300
    assert r["periodic/share/reuse"]["x_no_savings"] == 3.0  # 450 / 150
    assert r["trl"]["x_sync_colocated"] is None and r["trl"]["x_no_savings"] is None


def test_cells_run_interleaved_and_figures_are_medians():
    calls = []

    def run_cell(name, rep):
        calls.append((name, rep))
        return {"tpspd": {"a": 10.0, "b": 20.0}[name] + rep, "wall_s": 1.0 + rep, "tool": "x"}

    samples = interleave(["a", "b"], 3, run_cell)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    row = median_row(samples["b"], ("tpspd", "wall_s", "absent"))
    assert row["tpspd"] == 21.0 and row["wall_s"] == 2.0 and row["absent"] is None
    assert row["tpspd_all"] == [20.0, 21.0, 22.0] and row["repeats"] == 3 and row["tool"] == "x"


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--cells", "periodic/share"], "unknown ablation cell 'periodic/share'"),
        (["--cells", "fast/share/reuse"], "PIPELINE one of sync-colocated, sync, periodic"),
        (["--cells", "trl,trl"], "names a cell twice"),
        (["--cells", " , "], "--cells is empty"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--iterations", "-1"], "--iterations must be >= 0"),
        (["--set", "pipeline.mode='fast'"], "pipeline.mode"),
    ],
)
def test_bad_input_exits_2_and_names_the_culprit(model_dir, tmp_path, capsys, extra, needle):
    assert main(cli_args(model_dir, tmp_path, *extra)) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_unavailable_cells_are_refused_with_the_reason(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trl_setup, "available", lambda: False)
    assert main(cli_args(model_dir, tmp_path, "--cells", "sync/share/reuse,trl")) == 2
    assert "pip install 'cadence[bench]'" in capsys.readouterr().err
    monkeypatch.setattr(ablation, "offpolicy_support", lambda config, overrides: "no such mode")
    assert main(cli_args(model_dir, tmp_path, "--cells", "offpolicy-1/share/reuse")) == 2
    assert "no such mode" in capsys.readouterr().err
    assert main(["bench", "--suite", "modes", "--cells", "trl", "--out", str(tmp_path)]) == 2
    assert "--cells applies to --suite ablation" in capsys.readouterr().err
