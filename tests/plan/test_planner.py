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
    "workload.micro_batch_tokens=2048",
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
        # 7B model's 137 GB of training state and reference, and a micro-batch of up to 2,304
        # tokens (a 256-token prompt and a 2,048-token response alone), checkpointed: 2,304 x
        # (28 x 3,584 + 0.6 x (8 x 3,584 + 4 x 18,944)) x 2 bytes of activations and 1,024 x
        # 152,064 x 20 bytes of logits, 3.9 GB, need 3 ranks of 72 GB)
        assert cluster.min_training_devices == 3
        assert len(separate) == 3 * (cluster.devices - 3)
        assert all(r.fits and r.shape.num_training >= 3 for r in separate)
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
            "cluster.devices=[3]",
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


LLAMA_70B = [
    *("model.params=70.6e9", "model.layers=80", "model.hidden=8192", "model.kv_dim=1024"),
    *("model.intermediate=28672", "model.vocab=128256"),
]


def test_the_learner_gets_as_many_training_devices_as_its_memory_needs():
    # 16 x 70.6e9 bytes of training state + a 141 GB reference = 1,271 GB; with one gathered layer
    # and its gradient (3.5 GB) and a checkpointed micro-batch of 2,304 tokens (2,304 x (80 x
    # 8,192 + 0.6 x (8 x 8,192 + 4 x 28,672)) x 2 bytes + 1,024 x 128,256 x 20 bytes of logits =
    # 6.1 GB), a rank of 72 GB holds 1/21 of it, not 1/20 (73.2 GB)
    result = plan(load_spec(None, [*SMALL, *LLAMA_70B, "cluster.devices=[24]"]))
    cluster = result.clusters[0]
    assert cluster.min_training_devices == 21
    separate = {r.shape.num_training for r in cluster.results if r.shape.placement == "separate"}
    assert separate == {21, 22, 23}
    assert cluster.recommended.shape.num_training >= 21 and cluster.recommended.fits
    assert any(
        "at least 21 training devices (fsdp: 73.2 GB per rank on 20" in n for n in result.notes
    )
    with pytest.raises(ConfigError, match=r"the learner does not fit \(ddp: 1,559\.3 GB per rank"):
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


def test_the_memory_model_counts_activations_checkpointing_and_logits_chunks():
    from cadence.plan.costs import ModelShape, activation_memory

    # Qwen2.5-7B's shape in bf16: per token per layer 8 x 3,584 + 4 x 18,944 = 104,448 values
    m = ModelShape(7.6e9, 28, 3584, 512, 2.0, 18944, 152064)
    full = activation_memory(m, 1000)
    assert full == pytest.approx(1000 * 28 * 104448 * 2 + 1000 * 152064 * 4 * 5)
    chunked = activation_memory(m, 1000, logits_chunk=256)
    assert full - chunked == pytest.approx((1000 - 256) * 152064 * 20)
    checkpointed = activation_memory(m, 1000, checkpointing=True, logits_chunk=256)
    assert checkpointed == pytest.approx(1000 * (28 * 3584 + 0.6 * 104448) * 2 + 256 * 152064 * 20)
    assert checkpointed < chunked / 5
    # the planner refuses what only the state would have let through: a long micro-batch, plain
    base = ["cluster.devices=[16]", "plan.modes=['sync']", "plan.iterations=1"]
    unplain = ["workload.activation_checkpointing=false", "workload.logits_chunk_tokens=0"]
    with pytest.raises(ConfigError, match="does not fit"):
        plan(load_spec(None, [*base, *unplain]))
    assert plan(load_spec(None, base)).clusters[0].recommended.fits
