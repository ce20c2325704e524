"""rollout.engine = 'vllm' in the pipeline: worker processes and the learner's own process,
sync and periodic making the same update, and the refusals (no vLLM, a model it cannot run)."""

import copy
import json
import multiprocessing

import pytest

from cadence.backend import RewardProcesses
from cadence.builder import build_run, checks, train
from cadence.cli import main
from cadence.config import ConfigError, load_config
from cadence.engine import Request, SamplingParams
from cadence.metrics import MemorySink
from cadence.models import ModelLoadError, init_model, load_model, load_tokenizer
from engine_checks import max_logprob_diff
from tiny_models import save_vllm_ready
from updates import assert_same_update, capture_grads, max_relative_diff

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    return save_vllm_ready(tmp_path_factory.mktemp("vllm") / "llama", "llama")


def _overrides(model_dir, mode="sync", placement="separate", *extra):
    return [
        f"model.path='{model_dir}'",
        f"pipeline.mode='{mode}'",
        f"pipeline.placement='{placement}'",
        "pipeline.prompts_per_task=1",
        "rollout.engine='vllm'",
        "rollout.vllm.enforce_eager=true",
        "rollout.max_num_seqs=16",
        "rollout.group_size=4",
        "rollout.max_new_tokens=10",
        "train.iterations=2",  # the second generates with the weights the first trained
        "train.prompts_per_iteration=4",
        "train.micro_batch_groups=2",
        "train.lr=1e-3",
        "train.checkpoint_every=0",
        "data.num_heldout=4",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:even_length'",
        *extra,
    ]


def _train(cfg, out):
    run = build_run(cfg)
    grads = capture_grads(run.trainer)
    sink = MemorySink()
    try:
        train(run, out, extra_sinks=[sink], evaluate=cfg.pipeline.placement == "colocated")
    finally:
        engine = run.heldout_accuracy.engine
        if engine.owns_weights:  # vLLM in this process: shut it down for the tests after
            engine.close()
    return run, sink.records, grads


@pytest.fixture(scope="module")
def sync_run(vllm_dir, tmp_path_factory):
    """Sync mode, one vLLM worker process: the reference the other placements must match."""
    out = tmp_path_factory.mktemp("sync")
    return _train(load_config(None, _overrides(vllm_dir, "sync")), out)


def test_periodic_with_vllm_workers_makes_the_sync_update(vllm_dir, sync_run, tmp_path):
    sync, sync_records, sync_grads = sync_run
    per_run, per_records, per_grads = _train(
        load_config(None, _overrides(vllm_dir, "periodic")), tmp_path
    )
    # the same samples (per-sample seeds, the same weights each iteration), summed in
    # completion order: the tolerances of tests/pipeline/test_periodic.py
    assert [r["reward_mean"] for r in per_records] == [r["reward_mean"] for r in sync_records]
    assert max_relative_diff(per_grads[0], sync_grads[0]) <= 1e-5
    assert_same_update(
        per_run.trainer.model, sync.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    for r in per_records:
        assert r["policy_version"] == r["iteration"] and r["staleness_max"] == 0
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(
            load_model(vllm_dir).parameters(), per_run.trainer.model.parameters(), strict=True
        )
    )
    assert moved > 1e-4  # trained: version k's samples came from weights loaded into vLLM
    assert not multiprocessing.active_children()


def test_colocated_vllm_trains_like_the_workers(vllm_dir, sync_run, tmp_path):
    # vLLM in the learner's process loads the learner's weights before each iteration; its
    # groups scored in reward processes, as a vLLM run on a GPU scores them by default
    sync, sync_records, sync_grads = sync_run
    stage = "reward.stage='separate'"
    col_run, col_records, col_grads = _train(
        load_config(None, _overrides(vllm_dir, "sync", "colocated", stage)), tmp_path
    )
    assert isinstance(col_run.source.worker.reward, RewardProcesses)  # not the worker's thread
    assert [r["reward_mean"] for r in col_records] == [r["reward_mean"] for r in sync_records]
    assert_same_update(
        col_run.trainer.model, sync.trainer.model, col_grads, sync_grads, grad_rtol=5e-5
    )
    assert all(r["t_weight_sync"] > 0 for r in col_records)
    weighs = sum(p.numel() * p.element_size() for p in col_run.trainer.model.parameters())
    assert all(r["weight_sync_bytes"] == weighs for r in col_records)


def test_colocated_vllm_with_lora_syncs_and_evaluates_the_merged_policy(vllm_dir, tmp_path):
    # it crashed at the first sync: the peft model's names (base_model.model..., lora_A) went to
    # vLLM, where worker processes are sent the merged weights; now the adapter goes alone
    lora = ("model.lora.r=4", "model.lora.alpha=8.0", "model.lora.target_modules=['q_proj']")
    extra = (*lora, "train.iterations=2", "train.lr=5e-2")  # an adapter that moves the policy
    cfg = load_config(None, _overrides(vllm_dir, "sync", "colocated", *extra))
    run = build_run(cfg)
    engine = run.heldout_accuracy.engine
    try:
        summary = train(run, tmp_path, evaluate=True)
        assert 0.0 <= summary["accuracy_after"] <= 1.0
        # the adapter alone reached vLLM at each sync (its LoRA requests), not the whole model
        adapter = sum(
            p.numel() * 4 for n, p in run.trainer.model.named_parameters() if "lora_" in n
        )
        records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["weight_sync_bytes"] for r in records] == [adapter] * 2
        assert len(engine.llm.llm_engine.list_loras()) == 1  # the old versions dropped
        run.heldout_accuracy.sync()  # what evaluation loads: the trained policy, merged
        tok = load_tokenizer(vllm_dir)
        requests = [Request(tok("What is 3 + 4?")["input_ids"], [1, 2])]
        outputs = engine.generate(requests, SamplingParams(max_new_tokens=8))
        merged = copy.deepcopy(run.trainer.model).merge_and_unload()
        assert max_logprob_diff(merged, requests, outputs, 1.0) <= 1e-5
        assert max_logprob_diff(load_model(vllm_dir), requests, outputs, 1.0) > 1e-3  # trained
    finally:
        engine.close()


def test_vllm_workers_take_each_lora_version_as_the_adapter_alone_and_sample_from_it(
    vllm_dir, tmp_path
):
    # before, each version reached the workers as the whole model with the adapter merged in
    lora = ("model.lora.r=4", "model.lora.alpha=8.0", "model.lora.target_modules=['q_proj']")
    extra = (*lora, "train.lr=5e-2")  # an adapter that moves the policy
    cfg = load_config(None, _overrides(vllm_dir, "periodic", "separate", *extra))
    run, records, _ = _train(cfg, tmp_path)
    adapter = sum(p.numel() * 4 for n, p in run.trainer.model.named_parameters() if "lora_" in n)
    assert run.source.pool.weights.num_bytes == adapter  # what each version moves
    assert all(r["weight_sync_bytes"] == adapter for r in records)
    # the worker sampled from the learner's version: the learner recomputes its log-probs
    assert max(r["behaviour_logprob_abs_diff_max"] for r in records) <= 1e-4
    trained = run.trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    assert trained.lora_B["default"].weight.abs().max() > 1e-3  # the adapter moved
    assert not multiprocessing.active_children()


def test_partial_rollouts_with_a_vllm_worker(vllm_dir, tmp_path):
    # the worker loads each version between two vLLM steps (keep); wherever the updates land,
    # every trained token is of the learner's version or the one before, as vLLM recorded it
    extra = ("pipeline.max_staleness=1", "pipeline.partial_rollout=true")
    cfg = load_config(None, _overrides(vllm_dir, "offpolicy", "separate", *extra))
    _, records, _ = _train(cfg, tmp_path)
    for r in records:
        tokens = r["tokens_by_version/0"] + r["tokens_by_version/1"]
        assert tokens == round(r["response_tokens_mean"] * 16)  # 4 prompts x 4 samples
        assert r["trajectory_staleness_worst"] <= 1 and r["dropped_groups"] == 0
    assert records[0]["tokens_by_version/1"] == 0  # iteration 0: version 0 throughout
    assert not multiprocessing.active_children()


def test_missing_vllm_exits_2_with_the_install_command(vllm_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(checks, "installed", lambda package: package != "vllm")
    (tmp_path / "run.toml").write_text("")
    args = ["train", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run")]
    for o in _overrides(vllm_dir):
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "rollout.engine = 'vllm' needs the package 'vllm'" in err
    assert "pip install 'cadence[vllm]'" in err
    with pytest.raises(ConfigError, match="pip install"):
        build_run(load_config(None, _overrides(vllm_dir)))


def test_a_model_vllm_cannot_run_stops_the_run_with_its_reason(tmp_path):
    init_model("test", tmp_path / "head16", ["1 + 2 = 3"] * 50, seed=0)  # heads of size 16
    cfg = load_config(None, _overrides(tmp_path / "head16", "periodic"))
    with pytest.raises(ModelLoadError, match=r"worker 0: vLLM cannot run .*head_dim=16"):
        build_run(cfg)
    assert not multiprocessing.active_children()


def test_the_engine_bench_has_a_vllm_row(vllm_dir, tmp_path):
    from cadence.bench import bench_engine

    rows = bench_engine(
        tmp_path, repeats=1, model_dir=vllm_dir, num_prompts=3, group_size=2, max_num_seqs=4
    )
    by = {(r["workload"], r["engine"]): r for r in rows}
    assert set(by) == {
        (w, e)
        for w in ("long-tail", "uniform")
        for e in ("static", "generate", "continuous", "vllm")
    }
    assert by["uniform", "vllm"]["new_tokens"] == 3 * 2 * 64  # no stop ids: every sample runs out
    assert 0 < by["long-tail", "vllm"]["new_tokens"] <= 3 * 2 * 256
    assert (
        by["uniform", "vllm"]["new_tokens_per_s"] > 0 and by["uniform", "vllm"]["first_group_s"] > 0
    )
    assert "| uniform | vllm |" in (tmp_path / "bench.md").read_text()


def test_vllm_in_a_ray_actor_makes_the_local_update(vllm_dir, sync_run, tmp_path):
    # over the broadcast: vLLM holds torch.distributed's default group in the actor, and the
    # weights' own group used to be a second default one (the run waited 5 minutes and died in
    # the driver). The object store's path is the Ray runs' of tests/backend/test_ray.py, and a
    # whole version into vLLM the local workers' here: one Ray + vLLM run pays for both.
    weight_sync = "broadcast"
    from cadence.backend.ray.pool import start_ray

    sync, sync_records, sync_grads = sync_run
    started = start_ray(None, num_cpus=2)
    try:
        extra = ("pipeline.backend='ray'", f"pipeline.weight_sync='{weight_sync}'")
        ray_run, ray_records, ray_grads = _train(
            load_config(None, _overrides(vllm_dir, "periodic", "separate", *extra)), tmp_path
        )
    finally:
        if started:
            import ray

            ray.shutdown()
    assert [r["reward_mean"] for r in ray_records] == [r["reward_mean"] for r in sync_records]
    assert_same_update(
        ray_run.trainer.model, sync.trainer.model, ray_grads, sync_grads, grad_rtol=5e-5
    )


def test_cadence_eval_decodes_a_lora_runs_adapter_on_vllm_as_the_merged_model(vllm_dir, tmp_path):
    # vLLM cannot load an adapter directory as a model: `cadence eval` of a LoRA run's final/
    # with rollout.engine = 'vllm' (configs/math-qwen.toml) failed in vLLM's config parsing
    import torch

    from cadence.builder.rollout import eval_engine
    from cadence.models.lora import LoraSpec, apply_lora

    spec = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj",))
    policy = apply_lora(load_model(vllm_dir), spec, vllm_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    final = tmp_path / "final"
    policy.save_pretrained(final)
    load_tokenizer(vllm_dir).save_pretrained(final)  # as a run's final/ holds it
    tok = load_tokenizer(final)
    engine, _ = eval_engine(
        load_config(None, _overrides(vllm_dir, "sync", "colocated")), tok, final
    )
    requests = [Request(tok("What is 3 + 4?")["input_ids"], [1, 2])]
    try:
        outputs = engine.generate(requests, SamplingParams(max_new_tokens=8, temperature=1.0))
    finally:
        engine.close()
    assert max_logprob_diff(load_model(final), requests, outputs, 1.0) <= 1e-5  # merged on load
    assert max_logprob_diff(load_model(vllm_dir), requests, outputs, 1.0) > 1e-2  # not the base
