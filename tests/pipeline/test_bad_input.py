"""Bad input and faults in a run: each is counted or named, and none leaves a process behind."""

import json
import math
import multiprocessing

import pytest
import torch

from cadence.builder import build_run, train
from cadence.cli import main
from cadence.config import load_config
from cadence.data import ArithmeticTask, DataError
from cadence.learner import BadStepsError
from cadence.metrics import MemorySink
from cadence.models import load_model, load_tokenizer
from cadence.pipeline import prompts as prompts_module
from cadence.pipeline.checkpoint_files import list_checkpoints
from cadence.pipeline.prompts import PromptFilter, PromptStream

TEMPLATE = "Question: {question}\nAnswer: "


def _overrides(model_dir, *extra):
    return [
        f"model.path='{model_dir}'",
        "train.iterations=2",
        "train.prompts_per_iteration=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "data.num_heldout=4",
        "algo.kl_coef=0.05",
        "train.lr=1e-3",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:even_length'",
        *extra,
    ]


def _sets(model_dir, *extra):
    return [a for o in _overrides(model_dir, *extra) for a in ("--set", o)]


def _length_filter(max_tokens, on_long):
    return PromptFilter(lambda text: list(range(len(text))), max_tokens, on_long)  # 1 token/char


def test_long_prompts_are_skipped_and_counted_and_the_cursor_moves_past_them():
    task = ArithmeticTask(difficulty=1, seed=0)
    plain = PromptStream(task, TEMPLATE, "a").next_batch(40)
    limit = sorted(len(p.text) for p in plain)[20]  # about half the prompts are longer
    stream = PromptStream(task, TEMPLATE, "a", fit=_length_filter(limit, "skip"))
    batch = stream.next_batch(8)
    expected = [p for p in plain if len(p.text) <= limit][:8]
    assert [p.uid for p in batch] == [p.uid for p in expected]  # the next examples take the place
    assert [p.index for p in batch] == list(range(8))  # positions in the batch: the seeds
    skipped = [p for p in plain[: plain.index(expected[-1])] if len(p.text) > limit]
    assert stream.fit.skipped == len(skipped) > 0
    assert stream.cursor == plain.index(expected[-1]) + 1


def test_long_prompts_are_truncated_to_their_last_tokens_and_counted():
    fit = PromptFilter(lambda text: [ord(c) for c in text], 10, "truncate")
    stream = PromptStream(ArithmeticTask(difficulty=1, seed=0), TEMPLATE, "a", fit=fit)
    batch = stream.next_batch(4)
    assert fit.truncated == 4 and fit.skipped == 0
    for p in batch:
        assert p.token_ids == tuple(ord(c) for c in p.text[-10:])  # the end the model continues


def test_a_stream_of_nothing_but_long_prompts_stops_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(prompts_module, "MAX_SKIPS_IN_A_ROW", 50)
    stream = PromptStream(ArithmeticTask(seed=0), TEMPLATE, "a", fit=_length_filter(3, "skip"))
    with pytest.raises(DataError, match=r"50 prompts in a row .*max_prompt_tokens = 3"):
        stream.next_batch(2)


@pytest.mark.slow
def test_truncated_prompts_are_generated_from_their_token_ids(model_dir, tmp_path):
    cfg = load_config(
        None,
        _overrides(
            model_dir,
            "rollout.max_prompt_tokens=6",
            "rollout.on_long_prompt='truncate'",
            "train.iterations=1",
        ),
    )
    memory = MemorySink()
    run = build_run(cfg)
    seen = []
    original = run.source.worker.rollout

    def spy(prompts, iteration, version):
        groups = original(prompts, iteration, version)
        seen.extend(groups)
        return groups

    run.source.worker.rollout = spy
    train(run, tmp_path, extra_sinks=[memory], evaluate=False)
    assert memory.records[-1]["prompts_truncated"] == 4
    assert all(len(g.prompt_ids) == 6 for g in seen)
    tokenizer = load_tokenizer(model_dir)
    assert [g.prompt_ids for g in seen] == [
        tokenizer(g.prompt.text, add_special_tokens=False)["input_ids"][-6:] for g in seen
    ]


@pytest.mark.slow
def test_reward_errors_are_marked_and_counted_and_the_run_goes_on_within_its_budget(
    model_dir, tmp_path
):
    cfg = load_config(
        None,
        _overrides(
            model_dir,
            "reward.function='fixtures_rewards:flaky'",
            "reward.max_error_fraction=0.9",
        ),
    )
    memory = MemorySink()
    train(build_run(cfg), tmp_path, extra_sinks=[memory], evaluate=False)
    assert [r["iteration"] for r in memory.records] == [0, 1]
    assert all(0 < r["reward_errors"] <= 16 for r in memory.records)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward_mean"]) for r in memory.records)


@pytest.mark.slow
def test_a_reward_over_its_error_budget_stops_the_run_and_leaves_no_process(
    model_dir, tmp_path, capsys
):
    args = ["train", "configs/default.toml", "--out", str(tmp_path)]
    extra = (
        "reward.function='fixtures_rewards:flaky'",
        "reward.max_error_fraction=0.1",
        "pipeline.placement='separate'",
        "pipeline.mode='periodic'",
        "train.iterations=20",
    )
    assert main([*args, *_sets(model_dir, *extra)]) == 1
    err = capsys.readouterr().err
    assert "run stopped" in err and "reward calls failed" in err
    assert not multiprocessing.active_children()
    assert not (tmp_path / "final").exists()


@pytest.mark.slow
def test_non_finite_steps_in_a_row_stop_the_run_without_saving_bad_weights(model_dir, tmp_path):
    cfg = load_config(
        None,
        _overrides(
            model_dir,
            "pipeline.placement='separate'",
            "pipeline.mode='periodic'",
            "train.iterations=6",
            "train.max_bad_steps=2",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=5",
        ),
    )
    run = build_run(cfg)
    learner = run.trainer
    good = {}

    def poison_after_first_iteration(module, args, output):
        if learner.version >= 1:  # iteration 0 trains; every later step is NaN
            good.setdefault(
                "weights", {n: p.detach().clone() for n, p in learner.model.named_parameters()}
            )
            return output * math.nan
        return output

    learner.model.lm_head.register_forward_hook(poison_after_first_iteration)
    memory = MemorySink()
    with pytest.raises(BadStepsError, match=r"3 optimizer steps in a row .*max_bad_steps = 2"):
        train(run, tmp_path, extra_sinks=[memory], evaluate=False)
    assert [r["skipped_steps"] for r in memory.records] == [0, 1, 1]
    assert not (tmp_path / "final").exists() and not multiprocessing.active_children()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in lines] == [0, 1, 1]
    saved = load_model(list_checkpoints(tmp_path)[-1] / "policy")  # after the last skipped step
    for name, p in saved.named_parameters():
        assert torch.isfinite(p).all() and torch.equal(p, good["weights"][name]), name


def test_empty_dataset_and_a_model_that_is_not_a_causal_lm_exit_2(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = ["train", "configs/default.toml", "--out", str(tmp_path / "run")]
    gsm8k = ("data.task='gsm8k'", f"data.path='{empty}'")
    assert main([*args, *_sets(model_dir, *gsm8k)]) == 2
    assert "no examples" in capsys.readouterr().err
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main([*args, *_sets(tmp_path / "not-a-model")]) == 2
    assert "not-a-model" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_reward_call_that_hangs_times_out_scores_0_and_the_run_goes_on(
    model_dir, tmp_path, placement
):
    # Before: a sleeping reward hung a colocated run forever; a separate one too, in the held-out
    # evaluation (the learner's process), and workers only failed after worker_timeout_s.
    extra = [
        "reward.function='fixtures_rewards:hang_on_odd_length'",
        "reward.timeout_s=0.3",
        "reward.max_error_fraction=0.9",
        f"pipeline.placement='{placement}'",
    ]
    if placement == "separate":
        extra.append("pipeline.mode='periodic'")
    args = ["train", "configs/default.toml", "--out", str(tmp_path)]
    assert main([*args, *_sets(model_dir, *extra)]) == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(0 < r["reward_timeouts"] == r["reward_errors"] < 16 for r in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reward_timeouts"] == sum(r["reward_timeouts"] for r in lines)
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_a_short_run_whose_every_reward_call_fails_stops_with_exit_1(model_dir, tmp_path, capsys):
    # Before: 3 iterations of 16 samples, every call raising, finished with final/ and exit 0
    # (the budget waited for 64 samples).
    extra = ("reward.function='fixtures_rewards:always_raises'", "train.iterations=3")
    args = ["train", "configs/default.toml", "--out", str(tmp_path)]
    assert main([*args, *_sets(model_dir, *extra)]) == 1
    err = capsys.readouterr().err
    assert "cadence: run stopped: 16 of 16 reward calls failed" in err
    assert "every reward call failed so far" in err
    assert "RuntimeError: the grader is down" in err
    assert not (tmp_path / "final").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # stopped after its first iteration


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_reward_that_cannot_be_imported_is_bad_input_exit_2(
    model_dir, tmp_path, capsys, placement
):
    extra = ["reward.function='nosuchmod:fn'", f"pipeline.placement='{placement}'"]
    args = ["train", "configs/default.toml", "--out", str(tmp_path)]
    assert main([*args, *_sets(model_dir, *extra)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cadence: error: reward spec 'nosuchmod:fn': cannot import module")
    assert "Traceback" not in err
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "algo, named",
    [
        (("algo.advantage='grpo'",), "algo.advantage = 'grpo' trains nothing"),
        (("algo.loss='rloo'", "algo.advantage='rloo'"), "algo.advantage = 'rloo' trains nothing"),
        (("algo.loss='online_dpo'", "algo.kl_coef=0"), "algo.loss = 'online_dpo' pairs"),
    ],
)
def test_one_sample_per_prompt_with_a_group_relative_algorithm_is_refused_exit_2(
    model_dir, tmp_path, capsys, algo, named
):
    # Before: rollout.group_size = 1 with GRPO trained with loss 0 and grad norm 0, exit 0.
    args = ["train", "configs/default.toml", "--out", str(tmp_path)]
    assert main([*args, *_sets(model_dir, "rollout.group_size=1", *algo)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cadence: error: ") and named in err
    if "online_dpo" not in named:
        assert "an advantage that works with group_size = 1: 'reinforce'" in err


def test_one_sample_per_prompt_works_with_an_advantage_that_needs_no_group():
    from cadence.builder import check_group_size, learns_from_one_sample

    check_group_size(load_config(None, ["rollout.group_size=1", "algo.advantage='reinforce'"]))
    assert learns_from_one_sample("reinforce")
    assert not learns_from_one_sample("grpo") and not learns_from_one_sample("rloo")


@pytest.mark.slow
def test_iterations_whose_every_group_has_equal_rewards_are_counted_and_warned_about(
    model_dir, tmp_path, caplog
):
    cfg = load_config(
        None,
        _overrides(
            model_dir,
            "reward.function='fixtures_rewards:always_one'",
            "train.iterations=3",
            "train.prompts_per_iteration=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=6",
        ),
    )
    memory = MemorySink()
    result = train(build_run(cfg), tmp_path, extra_sinks=[memory], evaluate=False)
    assert [(r["constant_reward_groups"], r["num_groups"]) for r in memory.records] == [(2, 2)] * 3
    assert result["constant_reward_iterations"] == 3
    assert "in each of the last 3 iterations (up to iteration 2" in caplog.text
    assert "every group's rewards were all equal" in caplog.text


def test_the_prompt_limit_defaults_to_what_the_model_takes_and_refuses_more():
    from cadence.builder import max_prompt_tokens
    from cadence.config import ConfigError

    cfg = load_config(None, ["rollout.max_new_tokens=48"])
    assert max_prompt_tokens(cfg, 1024) == 1024 - 48  # 0: the model's positions minus the reply
    assert max_prompt_tokens(cfg, None) == 0  # a model that states no limit
    assert max_prompt_tokens(load_config(None, ["rollout.max_prompt_tokens=500"]), 1024) == 500
    with pytest.raises(ConfigError, match=r"max_prompt_tokens = 1000 plus .* 1024 positions"):
        max_prompt_tokens(load_config(None, ["rollout.max_prompt_tokens=1000"]), 1024)
    with pytest.raises(ConfigError, match=r"max_new_tokens = 1024 leaves no room"):
        max_prompt_tokens(load_config(None, ["rollout.max_new_tokens=1024"]), 1024)


def test_the_prompt_limit_leaves_room_for_a_whole_episode_and_vllms_max_model_len():
    from cadence.builder import max_prompt_tokens
    from cadence.config import ConfigError

    # the tool env's defaults: a 256-token episode; before, 512 - 48 = 464 was let in
    tool = load_config(None, ["env.kind='tool'", "rollout.max_new_tokens=48"])
    assert max_prompt_tokens(tool, 512) == 512 - 256
    with pytest.raises(ConfigError, match=r"plus env.max_total_tokens = 256 exceeds the model's"):
        max_prompt_tokens(
            load_config(None, ["env.kind='tool'", "rollout.max_prompt_tokens=300"]), 512
        )
    vllm = ["rollout.engine='vllm'", "rollout.vllm.max_model_len=128", "rollout.max_new_tokens=48"]
    assert max_prompt_tokens(load_config(None, vllm), 1024) == 128 - 48
    assert max_prompt_tokens(load_config(None, vllm), None) == 128 - 48
    assert max_prompt_tokens(load_config(None, vllm), 100) == 100 - 48  # the model's is lower
    with pytest.raises(
        ConfigError,
        match=r"env.max_total_tokens = 256 leaves no room .* "
        r"rollout.vllm.max_model_len = 128",
    ):
        max_prompt_tokens(load_config(None, [*vllm, "env.kind='tool'"]), 1024)


@pytest.mark.slow
@pytest.mark.parametrize("on_long", ["skip", "truncate"])
def test_a_prompt_longer_than_the_model_takes_is_never_fed_to_it(model_dir, tmp_path, on_long):
    # Before: a 10,000-token prompt (model limit 1,024 positions) ran with no warning, 5 GB RSS
    # and 59 s for one iteration.
    tokenizer = load_tokenizer(model_dir)
    long_question = "What is " + "12 + " * 3000 + "1?"
    assert len(tokenizer(long_question)["input_ids"]) > 10_000
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i in range(9)
    ]
    rows.insert(3, {"question": long_question, "answer": "#### 36001"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = (
        "data.task='gsm8k'",
        f"data.path='{data}'",
        "data.num_heldout=2",
        "train.iterations=1",
        "train.prompts_per_iteration=8",  # every training example, the long one included
        "rollout.group_size=2",
        f"rollout.on_long_prompt='{on_long}'",
    )
    run = build_run(load_config(None, _overrides(model_dir, *extra)))
    seen = []
    original = run.source.worker.rollout

    def spy(prompts, iteration, version):
        groups = original(prompts, iteration, version)
        seen.extend(groups)
        return groups

    run.source.worker.rollout = spy
    memory = MemorySink()
    train(run, tmp_path / "run", extra_sinks=[memory], evaluate=False)
    (record,) = memory.records
    limit = run.trainer.model.config.max_position_embeddings - 12  # minus max_new_tokens
    assert max(len(g.prompt_ids) for g in seen) <= limit
    assert record[f"prompts_{'skipped' if on_long == 'skip' else 'truncated'}"] == 1


@pytest.mark.slow
def test_skipped_bad_lines_are_counted_in_metrics_and_summary(model_dir, tmp_path, caplog):
    # Before: data.on_bad_line = "skip" never said how many lines it skipped.
    good = [
        {"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
        for i in range(8)
    ]
    lines = [json.dumps(r) for r in good]
    lines[2:2] = ["not json", json.dumps({"question": "no answer"})]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    extra = (
        "data.task='gsm8k'",
        f"data.path='{data}'",
        "data.on_bad_line='skip'",
        "data.num_heldout=2",
        "train.prompts_per_iteration=2",
        "rollout.group_size=2",
    )
    args = ["train", "configs/default.toml", "--out", str(tmp_path / "run")]
    assert main([*args, *_sets(model_dir, *extra)]) == 0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["bad_lines_skipped"] for r in records] == [2, 2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["bad_lines_skipped"] == 2
    assert f"skipped 2 malformed line(s) of {data}" in caplog.text


@pytest.mark.parametrize("kind", ["llama classifier", "bert classifier", "needs its own code"])
def test_a_model_directory_it_would_load_wrong_is_bad_input_exit_2(
    model_dir, tmp_path, capsys, kind
):
    # Before: a Llama classifier trained with a random lm_head (exit 0); a BERT one and a model
    # that needs trust_remote_code ended in tracebacks (exit 1).
    import shutil

    from tiny_models import classifier_dir

    path = tmp_path / "model"
    if kind == "needs its own code":
        shutil.copytree(model_dir, path)
        config = json.loads((path / "config.json").read_text())
        config |= {"model_type": "mystery", "auto_map": {"AutoConfig": "x.MysteryConfig"}}
        (path / "config.json").write_text(json.dumps(config))
    else:
        classifier_dir(model_dir, path, kind.split()[0])
    args = ["train", "configs/default.toml", "--out", str(tmp_path / "run")]
    assert main([*args, *_sets(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cadence: error: '{path}'") and "Traceback" not in err
    assert ("not a causal language model" in err) != (kind == "needs its own code")


def test_workers_that_stop_answering_end_the_run_in_one_line(monkeypatch, capsys):
    import cadence.cli.args

    def stuck(args):
        raise TimeoutError("no word from the workers for 300s (pipeline.worker_timeout_s)")

    monkeypatch.setattr(cadence.cli.args, "cmd_train", stuck)
    assert main(["train", "configs/default.toml"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "cadence: run stopped: no word from the workers for 300s (pipeline.worker_timeout_s)\n"
    )
