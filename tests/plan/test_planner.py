"""The planner: every mode on the splits worth trying, and a recommendation that is the best."""

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from cadence.config import ConfigError
from cadence.plan import load_spec, plan
from cadence.plan.planner import TIE, recommend, search_splits
from cadence.plan.report import print_plan

SMALL = [
    "workload.prompts_per_iteration=16",
    "workload.group_size=4",
    "workload.max_new_tokens=2048",
    "workload.micro_batch_groups=4",
    "workload.response.mean=300",
    "plan.iterations=3",
    "plan.modes=['sync-colocated', 'sync', 'periodic', 'offpolicy-1']",
]


def test_recommended_split_maximises_tpspd_over_every_simulated_split():
    result = plan(load_spec(None, [*SMALL, "cluster.devices=[4, 6]"]))
    assert [c.devices for c in result.clusters] == [4, 6]
    for cluster in result.clusters:
        best = max(r.tpspd for r in cluster.results)
        assert cluster.recommended.tpspd >= best * (1 - TIE)
        separate = [r for r in cluster.results if r.shape.placement == "separate"]
        # few candidates: every split of every separate mode whose learner fits is simulated (the
        # 7B model's 137 GB of training state and reference need 2 ranks of 72 GB)
        assert cluster.min_training_devices == 2
        assert len(separate) == 3 * (cluster.devices - 2)
        assert all(r.fits and r.shape.num_training >= 2 for r in separate)
        for label, r in cluster.best.items():
            assert r.tpspd == max(x.tpspd for x in cluster.results if x.shape.label == label)


def test_a_tie_goes_to_the_less_stale_mode():
    def result(label_staleness, tpspd, num_inference=4):
        return SimpleNamespace(
            tpspd=tpspd,
            staleness={label_staleness: 10},
            shape=SimpleNamespace(num_inference=num_inference),
        )

    fresh, stale = result(0, 1000.0), result(2, 1000.5)
    assert recommend([stale, fresh]) is fresh  # 0.05% apart: a tie
    faster = result(2, 1100.0)
    assert recommend([fresh, faster]) is faster


def test_every_mode_sees_the_same_responses():
    result = plan(load_spec(None, [*SMALL, "cluster.devices=[4]"]))
    tokens = {round(r.tokens_per_iteration) for r in result.clusters[0].results}
    assert len(tokens) == 1


def test_search_finds_the_peak_of_a_single_peaked_curve_without_trying_every_split():
    candidates = list(range(1, 64))

    def evaluate(i):
        return SimpleNamespace(tpspd=-abs(i - 41) - 0.01 * i)

    seen = search_splits(candidates, evaluate)
    assert max(seen, key=lambda i: seen[i].tpspd) == 41
    assert len(seen) < len(candidates) / 2


def test_explicit_splits_are_the_only_ones_simulated():
    result = plan(load_spec(None, [*SMALL, "cluster.devices=[8]", "plan.splits=[2, 5, 9]"]))
    splits = {r.shape.num_inference for r in result.clusters[0].results if r.shape.num_training}
    assert splits == {2, 5, 8}  # 9 does not fit in 8 devices; 8 is sync-colocated's all


def test_empirical_lengths_from_a_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"response_tokens_mean": m}) + "\n" for m in (20, 30)))
    spec = load_spec(
        None,
        [
            *SMALL,
            "cluster.devices=[2]",
            "workload.response.kind='empirical'",
            f"workload.response.path='{path}'",
        ],
    )
    result = plan(spec)
    assert "per-iteration means" in result.notes[0]
    # every response is 20 or 30 tokens long, after a prompt of 256
    r = result.clusters[0].results[0]
    assert 16 * 4 * (256 + 20) <= r.tokens_per_iteration <= 16 * 4 * (256 + 30)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("hardware.flops=-1", "hardware.flops"),
        ("plan.modes=['fast']", "plan.modes"),
        ("plan.modes=['offpolicy-0']", "plan.modes"),
        ("plan.modes=['offpolicy-1-recompute']", "plan.modes"),
        ("plan.modes=['partial-0']", "plan.modes"),
        ("workload.response.kind='empirical'", "workload.response.path"),
        ("workload.response.kind='fixed'", "workload.response.tokens"),  # 512 > 256 cap below
        ("cluster.devices=[]", "cluster.devices"),
        ("hardware.profile='/nonexistent/profile.json'", "hardware.profile"),
        ("model.layres=3", "model.layres"),
    ],
)
def test_bad_input_names_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        plan(load_spec(None, ["workload.max_new_tokens=256", override]))


LLAMA_70B = ["model.params=70.6e9", "model.layers=80", "model.hidden=8192", "model.kv_dim=1024"]


def test_the_learner_gets_as_many_training_devices_as_its_memory_needs():
    # 16 x 70.6e9 bytes of training state + a 141 GB reference = 1,271 GB; with one gathered layer
    # and its gradient (3.5 GB), a rank of 72 GB holds 1/19 of it, not 1/18 (74.1 GB)
    result = plan(load_spec(None, [*SMALL, *LLAMA_70B, "cluster.devices=[24]"]))
    cluster = result.clusters[0]
    assert cluster.min_training_devices == 19
    assert {r.shape.num_training for r in cluster.results if r.shape.placement == "separate"} == {
        19,
        20,
        21,
        22,
        23,
    }
    assert cluster.recommended.shape.num_training >= 19 and cluster.recommended.fits
    assert any(
        "at least 19 training devices (fsdp: 74.1 GB per rank on 18" in n for n in result.notes
    )
    with pytest.raises(ConfigError, match=r"the learner does not fit \(ddp: 1,270\.8 GB per rank"):
        plan(
            load_spec(
                None, [*SMALL, *LLAMA_70B, "cluster.devices=[24]", "cluster.learner_strategy=ddp"]
            )
        )


def test_partial_modes_are_planned_next_to_offpolicy():
    spec = load_spec(
        None,
        [
            "workload.max_new_tokens=256",
            "cluster.devices=[4]",
            "plan.modes=['offpolicy-1', 'partial-1', 'partial-1-recompute']",
        ],
    )
    result = plan(spec)
    (cluster,) = result.clusters
    assert set(cluster.best) == {"offpolicy-1", "partial-1", "partial-1-recompute"}
    out = io.StringIO()
    print_plan(result, Console(file=out, width=160))
    rows = [line.split()[1] for line in out.getvalue().splitlines() if "-1" in line[:30]]
    assert rows[:3] == ["offpolicy-1", "partial-1", "partial-1-recompute"]
    assert cluster.best["partial-1"].shape.partial == "keep"
    assert cluster.best["partial-1-recompute"].shape.partial == "recompute"
