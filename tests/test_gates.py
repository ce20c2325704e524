"""The learning gates (gates.py) catch what they are for: a group not of the published version,
a first-step ratio off 1, an engine whose log-probs are not the learner's."""

import json

import pytest

import gates

pytestmark = pytest.mark.no_learning_gates  # the runs here are crafted, broken on purpose

GOOD = {
    "iteration": 0,
    "policy_version": 0,
    "staleness_max": 0,
    "dropped_groups": 0,
    "first_step_ratio_abs_dev_max": 0.0,
    "behaviour_logprob_abs_diff_max": 1e-6,
}


def _run(tmp_path, records, config='[pipeline]\nmode = "sync"\n'):
    (tmp_path / "config.toml").write_text(config)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert gates.run_dirs(tmp_path) == [tmp_path]
    return gates.check_run(tmp_path)


def test_a_healthy_on_policy_run_passes(tmp_path):
    assert _run(tmp_path, [GOOD, GOOD | {"iteration": 1, "policy_version": 1}]) == []


def test_each_broken_figure_is_named(tmp_path):
    broken = [
        GOOD | {"staleness_max": 1},
        GOOD | {"first_step_ratio_abs_dev_max": 1e-3},
        GOOD | {"behaviour_logprob_abs_diff_max": 0.5},
    ]
    found = _run(tmp_path, broken)
    assert len(found) == 3
    assert "not of the published version" in found[0]
    assert "|ratio - 1| = 0.001" in found[1]
    assert "behaviour_logprob_abs_diff_max = 0.5 > 2e-05" in found[2]


def test_off_policy_and_the_bypass_are_not_held_to_the_on_policy_gates(tmp_path):
    stale = GOOD | {"staleness_max": 2}
    assert _run(tmp_path, [stale], '[pipeline]\nmode = "offpolicy"\n') == []
    off = GOOD | {"first_step_ratio_abs_dev_max": 1e-3}
    assert _run(tmp_path, [off], '[algo]\ncorrection_proximal = "bypass"\n') == []


def test_a_bf16_run_is_held_to_its_mean_gap(tmp_path):
    # before, every gate skipped a run that was not float32: the GPU's precision went unchecked
    bf16 = '[model]\ndtype = "bfloat16"\n'
    right = GOOD | {"behaviour_logprob_abs_diff_mean": 3e-4, "behaviour_logprob_abs_diff_max": 0.06}
    assert _run(tmp_path, [right], bf16) == []
    wrong = right | {"behaviour_logprob_abs_diff_mean": 0.16}
    assert "behaviour_logprob_abs_diff_mean = 0.16" in _run(tmp_path, [wrong], bf16)[0]


def test_the_history_gate_is_two_sided_and_refuses_a_missing_or_nan_value():
    import history

    trusted = {"sync": {str(s): {"reward_mean": [0.4, 0.5 + 0.02 * s], "entropy": [1.0, 1.0]}
                        for s in range(5)}}  # fmt: skip

    def records(*rewards):
        return [{"reward_mean": r, "entropy": 1.0} for r in rewards]

    assert history.off_history("sync", records(0.42, 0.55), trusted) == []
    worse, better = records(0.4, 0.3), records(0.4, 0.9)  # the band at 1: [0.44, 0.64]
    assert "below the history's" in history.off_history("sync", worse, trusted)[0]
    assert "above the history's" in history.off_history("sync", better, trusted)[0]
    assert "not finite" in history.off_history("sync", records(0.4, float("nan")), trusted)[0]
    assert "1 iterations" in history.off_history("sync", records(0.4), trusted)[0]
    assert "no history" in history.off_history("tool", records(0.4, 0.5), trusted)[0]
