"""benchmarks/plan_vs_measured.py runs each of the planner's modes for real: the config it builds
for a mode name must be the mode the planner simulated under that name."""

import sys
from pathlib import Path

import pytest

from cadence.config import ConfigError, load_config

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import plan_vs_measured

CONFIG = "configs/bench-longtail.toml"


@pytest.mark.parametrize(
    ("name", "mode", "staleness", "partial", "kv"),
    [
        ("periodic", "periodic", None, False, None),
        ("offpolicy-2", "offpolicy", 2, False, None),
        ("partial-1", "offpolicy", 1, True, "keep"),
        ("partial-1-recompute", "offpolicy", 1, True, "recompute"),
    ],
)
def test_a_named_mode_runs_as_the_planner_simulates_it(name, mode, staleness, partial, kv):
    cfg = load_config(CONFIG, plan_vs_measured.mode_overrides(name)).pipeline
    assert (cfg.mode, cfg.placement, cfg.partial_rollout) == (mode, "separate", partial)
    if staleness is not None:
        assert cfg.max_staleness == staleness
    if kv is not None:
        assert cfg.partial_rollout_kv == kv


def test_a_mode_the_planner_does_not_know_is_refused_by_name():
    with pytest.raises(ConfigError, match="'partial-0'"):
        plan_vs_measured.mode_overrides("partial-0")
