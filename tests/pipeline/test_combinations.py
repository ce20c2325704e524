"""The joints: every pair of choices a user puts together trains, and a combination that cannot
is refused when the config is read (exit 2, the reason), never at iteration 1.

Five factors: the engine, the placement, the environment, full or LoRA training, one learner or
two ranks. Running all 2^5 combinations would cost minutes; a fault where two parts meet shows in
any run that holds that pair of values, so the runs here are a covering array: a set of allowed
combinations in which every pair of values of any two factors that some allowed combination
holds appears at least once. It is computed from `FACTORS` and `REFUSED` (a value added to a
factor is covered without anything else changing) and the covering property itself is asserted.
Each run is `cadence train` in this process (`cli.main`: its exit code), 2 iterations of 2
prompts x 4 samples of a few tokens on a tiny model vLLM can run too. Separate placement runs
periodic mode (what it is for); colocated runs sync (the only mode it has).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

import cadence.builder
from cadence.cli import main
from cadence.config import ConfigError, load_config
from tiny_models import save_vllm_ready

FACTORS: dict[str, tuple] = {
    "engine": ("continuous", "vllm"),
    "placement": ("colocated", "separate"),
    "env": ("single_turn", "tool"),
    "weights": ("full", "lora"),
    "ranks": (1, 2),
}

# Pairs of values that cannot go together, each with the two config keys its refusal names.
REFUSED: dict[frozenset, tuple[str, str]] = {
    frozenset({("weights", "lora"), ("ranks", 2)}): ("learner.ranks", "model.lora"),
}

# What a run costs beyond the others (an engine to start, processes to spawn): the covering
# array prefers the cheaper of two runs that cover as many missing pairs.
COST = {("engine", "vllm"): 3, ("placement", "separate"): 2, ("ranks", 2): 2}


def _settings(combo: dict) -> list[str]:
    """The `--set` overrides of one combination (without the model)."""
    mode = "periodic" if combo["placement"] == "separate" else "sync"
    sets = [f"rollout.engine='{combo['engine']}'", f"pipeline.placement='{combo['placement']}'"]
    sets += [f"pipeline.mode='{mode}'", f"env.kind='{combo['env']}'"]
    if combo["env"] == "tool":  # an episode's budget the model's 256 positions leave room for
        sets += ["env.max_turns=2", "env.max_total_tokens=24"]
    if combo["weights"] == "lora":
        sets += ["model.lora.r=4", "model.lora.alpha=8.0"]
    sets.append(f"learner.ranks={combo['ranks']}")
    if combo["engine"] == "vllm":
        sets += ["rollout.vllm.enforce_eager=true", "rollout.max_num_seqs=8"]
    return sets


TINY = [
    "train.iterations=2",
    "train.prompts_per_iteration=2",
    "train.micro_batch_groups=1",
    "train.lr=1e-2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "data.num_heldout=2",
    "metrics.progress=false",
    "reward.function='fixtures_rewards:even_length'",  # a spread of rewards: something to learn
]


def pairs(combo: dict) -> set[frozenset]:
    """Every pair of (factor, value) of `combo`."""
    return {frozenset(p) for p in itertools.combinations(combo.items(), 2)}


def every_combination() -> list[dict]:
    return [
        dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())
    ]


def refusals(combo: dict) -> list[tuple[str, str]]:
    """The keys of each refused pair in `combo` (none: it is allowed)."""
    return [REFUSED[p] for p in pairs(combo) if p in REFUSED]


def covering_runs(tries: int = 64) -> list[dict]:
    """Allowed combinations covering every pair that some allowed combination holds, as few as
    the search finds, the cheapest of those. Each try is a greedy pass over the combinations in
    a seeded random order (each step takes the one covering the most pairs still missing, the
    cheaper on a tie, then the earlier in that order: AETG's way of building covering arrays),
    then drops every run the others make redundant."""
    allowed = [c for c in every_combination() if not refusals(c)]
    needed = set().union(*map(pairs, allowed))
    rng = random.Random(0)
    best: list[dict] = allowed
    for _ in range(tries):
        order = rng.sample(allowed, len(allowed))
        runs = _without_redundant(_greedy(order, needed), needed)
        if (len(runs), sum(map(_cost, runs))) < (len(best), sum(map(_cost, best))):
            best = runs
    return sorted(best, key=every_combination().index)


def _greedy(order: list[dict], needed: set[frozenset]) -> list[dict]:
    missing, runs = set(needed), []
    while missing:
        run = max(order, key=lambda c: (len(pairs(c) & missing), -_cost(c)))
        runs.append(run)
        missing -= pairs(run)
    return runs


def _without_redundant(runs: list[dict], needed: set[frozenset]) -> list[dict]:
    """`runs` less each run (the dearest first) whose pairs the others cover."""
    kept = list(runs)
    for run in sorted(runs, key=_cost, reverse=True):
        others = [r for r in kept if r is not run]
        if set().union(*map(pairs, others)) >= needed:
            kept = others
    return kept


def _cost(combo: dict) -> int:
    return sum(COST.get(item, 0) for item in combo.items())


def _name(combo: dict) -> str:
    return "-".join(f"{v}" if k != "ranks" else f"{v}rank" for k, v in combo.items())


RUNS = covering_runs()


def test_the_runs_cover_every_pair_of_values_that_can_go_together():
    allowed = [c for c in every_combination() if not refusals(c)]
    assert all(not refusals(c) for c in RUNS)
    covered = set().union(*map(pairs, RUNS))
    assert covered == set().union(*map(pairs, allowed))
    for factor, values in FACTORS.items():  # every value runs, with every other factor's
        assert {c[factor] for c in RUNS} == set(values)
    assert len(RUNS) < len(allowed)  # the point of a covering array: fewer runs than all
    # a pair that is refused is never run, and is the only kind of pair never covered
    every_pair = {
        frozenset({(a, x), (b, y)})
        for a, b in itertools.combinations(FACTORS, 2)
        for x in FACTORS[a]
        for y in FACTORS[b]
    }
    assert every_pair - covered == set(REFUSED)


@pytest.mark.parametrize("combo", every_combination(), ids=_name)
def test_a_combination_is_refused_when_the_config_is_read_or_not_at_all(combo):
    sets = ["model.path='no-such-model'", *_settings(combo)]
    expected = refusals(combo)
    if not expected:
        load_config(None, sets)  # accepted: it trains (the runs below)
        return
    with pytest.raises(ConfigError) as refused:
        load_config(None, sets)
    message = str(refused.value)
    assert any(a in message and b in message for a, b in expected), message


def _pair_name(pair: frozenset) -> str:
    return "+".join(f"{factor}={value}" for factor, value in sorted(pair))


@pytest.mark.parametrize("pair", list(REFUSED), ids=_pair_name)
def test_cadence_train_exits_2_with_the_reason_before_loading_any_model(pair, tmp_path, capsys):
    # the model directory does not exist: a refusal that came after the config was read would
    # say so instead of giving the combination's reason
    combo = next(c for c in every_combination() if pair in pairs(c))
    args = ["train", str(_config_file(tmp_path)), "--out", str(tmp_path / "run")]
    for s in [f"model.path='{tmp_path / 'no-such-model'}'", *_settings(combo), *TINY]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    a, b = REFUSED[pair]
    assert err.startswith("cadence: error: ") and a in err and b in err, err
    assert "does not exist" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("sets", "keys"),
    [  # the episode's budget against the model's 256 positions (config.json), and vLLM's cap
        (
            ["env.kind='tool'", "env.max_total_tokens=256"],
            ("env.max_total_tokens", "256 positions"),
        ),
        (
            [
                "env.kind='tool'",
                "rollout.engine='vllm'",
                "rollout.vllm.max_model_len=128",
                "env.max_total_tokens=128",
            ],
            ("env.max_total_tokens", "rollout.vllm.max_model_len"),
        ),
    ],
)
def test_a_budget_that_leaves_no_room_for_a_prompt_exits_2_before_any_weight_loads(
    sets, keys, model_path, tmp_path, capsys, monkeypatch
):
    import cadence.builder.run

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(cadence.builder.run, "load_model", no_loading)
    args = ["train", str(_config_file(tmp_path)), "--out", str(tmp_path / "run")]
    for s in [f"model.path='{model_path}'", *TINY, *sets]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "leaves no room for a prompt" in err and all(k in err for k in keys), err


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny Llama that every engine here runs (vLLM's CPU attention needs heads of size 32,
    the 'test' preset's are 16), with the arithmetic task's tokenizer."""
    return save_vllm_ready(tmp_path_factory.mktemp("combinations") / "llama", "llama")


@pytest.fixture
def closing_engines(monkeypatch):
    """`cadence train` in this process: a colocated vLLM engine is shut down after each run (a
    process of its own would simply exit), so the next run can start one."""
    real = cadence.builder.train

    def train_and_close(run, out, *args, **kwargs):
        try:
            return real(run, out, *args, **kwargs)
        finally:  # colocated, the engine that generated is the one that evaluated
            worker = getattr(run.source, "worker", None)
            if worker is not None and worker.engine.owns_weights:
                worker.engine.close()

    monkeypatch.setattr(cadence.builder, "train", train_and_close)


@pytest.mark.slow
@pytest.mark.parametrize("combo", RUNS, ids=_name)
def test_every_pair_trains_two_iterations(combo, model_path, closing_engines, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", str(_config_file(tmp_path)), "--out", str(out)]
    for s in [f"model.path='{model_path}'", *_settings(combo), *TINY]:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    for r in records:
        bad = {k: v for k, v in _numbers(r) if not math.isfinite(v)}
        assert not bad, bad
        assert r["policy_version"] == r["iteration"] and r["staleness_max"] == 0
        assert r["learner_ranks"] == combo["ranks"] and r["num_groups"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    for name in ("config.toml", "trace.json", "checkpoints/iter-000002/manifest.json"):
        assert (out / name).is_file(), name
    # the seeded samples of every run here have groups with a spread of rewards: a gradient
    assert any(r["constant_reward_groups"] < r["num_groups"] for r in records)
    assert all(r["grad_norm"] > 0 for r in records if r["constant_reward_groups"] < r["num_groups"])
    assert _moved(out / "final", model_path, combo["weights"]) > 1e-4  # it trained


def _numbers(record: dict):
    for key, value in record.items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int | float):
                yield key, float(v)


def _moved(final: Path, model_path: str, weights: str) -> float:
    """How far training moved the policy: its largest parameter change, or for LoRA the
    largest entry of an adapter's B (zero at the start)."""
    if weights == "lora":
        adapter = load_file(final / "adapter_model.safetensors")
        return max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k)
    before = load_file(Path(model_path) / "model.safetensors")
    after = load_file(final / "model.safetensors")
    return max((after[k] - before[k]).abs().max().item() for k in before)
