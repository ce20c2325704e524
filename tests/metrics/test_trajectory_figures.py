"""Per-token versions as figures: spans, trajectory staleness, tokens per version."""

from cadence.metrics import sample_figures
from cadence.types import Completion, Group, Prompt


def _group(policy_version, *stamps, reward=1.0):
    completions = [
        Completion([7] * len(s), [0.0] * len(s), reward=reward, token_versions=s) for s in stamps
    ]
    return Group(Prompt("p", "", ""), [0], completions, policy_version, iteration=5)


def test_figures_of_trajectories_that_span_versions():
    # learner at 5, N = 2; three trajectories: [3 3 4 4 4], [4 4], [5]
    groups = [_group(3, [3, 3, 4, 4, 4], [4, 4]), _group(5, [5])]
    f = sample_figures(groups, version=5, max_staleness=2)
    assert f["trajectory_spans"] == (2 + 1 + 1) / 3
    assert f["trajectory_staleness_mean"] == (2 + 1 + 0) / 3
    assert f["trajectory_staleness_worst"] == 2
    # lag 0: one token of 5; lag 1: five of 4; lag 2: two of 3
    assert [f[f"tokens_by_version/{lag}"] for lag in range(3)] == [1, 5, 2]
    assert f["staleness_hist"] == [1, 0, 1]  # groups, by the version they began with


def test_without_partial_rollouts_a_trajectory_is_its_group():
    groups = [_group(4, [4, 4, 4], [4]), _group(4, [], [4, 4])]  # an empty response too
    f = sample_figures(groups, version=5, max_staleness=1)
    assert f["trajectory_spans"] == 1.0
    assert f["trajectory_staleness_mean"] == f["staleness_mean"] == 1.0
    assert f["trajectory_staleness_worst"] == f["staleness_max"] == 1
    assert [f["tokens_by_version/0"], f["tokens_by_version/1"]] == [0, 6]
