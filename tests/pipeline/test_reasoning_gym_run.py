"""A run that mixes two reasoning-gym tasks trains on the tiny model and reports reward and
held-out accuracy per task, in metrics.jsonl and the summary; the rows' metadata reaches the
reward wherever it scores (colocated, or in worker processes)."""

from __future__ import annotations

import json
import math
from itertools import islice

import pytest

from cadence.builder import build_run, make_task, train
from cadence.config import load_config
from cadence.engine import ScriptedEngine

TASKS = ("basic_arithmetic", "chain_sum")
SMALL = "{ min_terms = 2, max_terms = 2, max_digits = 1 }"


def _cfg(model_dir, *extra: str):
    return load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "data.task='reasoning_gym'",
            "data.num_heldout=8",
            "data.reasoning_gym.size=64",
            *(f"data.reasoning_gym.datasets.{t}.config={SMALL}" for t in TASKS),
            "train.iterations=2",
            "train.prompts_per_iteration=4",
            "train.eval_every=1",
            "train.lr=1e-3",
            "rollout.group_size=4",
            "rollout.max_new_tokens=8",
            "metrics.progress=false",
            *extra,
        ],
    )


def _lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _finite(record: dict) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, int | float))


@pytest.mark.slow
def test_two_tasks_train_and_report_per_task_figures(model_dir, tmp_path) -> None:
    cfg = _cfg(
        model_dir,
        "data.chat_template=true",
        "data.reasoning_gym.developer_prompt='Put the answer in <answer></answer>.'",
    )
    summary = train(build_run(cfg), tmp_path)
    lines = _lines(tmp_path)
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(_finite(r) for r in lines) and _finite(summary)
    assert sum(r["reward_errors"] for r in lines) == 0  # every row's metadata reached its grader
    trained = {k.partition("/")[2] for r in lines for k in r if k.startswith("reward_mean/")}
    assert trained == set(TASKS)
    for r in lines:
        for task in TASKS:
            assert 0.0 <= r[f"heldout_accuracy/{task}"] <= 1.0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for task in TASKS:
        for key in ("reward_mean_first", "reward_mean_last", "accuracy_before", "accuracy_after"):
            assert math.isfinite(on_disk[f"{key}/{task}"]), (key, task)
    assert on_disk["accuracy_after/chain_sum"] == lines[-1]["heldout_accuracy/chain_sum"]


def _answers(cfg) -> dict[str, tuple[str, str]]:
    """question -> (its dataset, its reference), over the held-out rows and a training epoch."""
    task = make_task(cfg)
    examples = task.heldout() + list(islice(task.train_iter(), 64))
    return {e.question: (e.task, e.answer) for e in examples}


@pytest.mark.slow
@pytest.mark.no_learning_gates  # a scripted engine samples
def test_each_task_is_scored_by_its_own_rows(model_dir, tokenizer, tmp_path) -> None:
    """A scripted policy answers basic_arithmetic right and chain_sum one off, in <answer> tags:
    the per-task figures are exactly 1 and 0, held out and in training."""
    # the script's log-probs are not the policy's: the sampler-learner gap is not watched
    cfg = _cfg(model_dir, "rollout.max_new_tokens=32", "pipeline.on_behaviour_gap='off'")
    answers = _answers(cfg)

    def reply(prompt_ids: list[int], seed: int) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        question = text.split("Question: ", 1)[1].rsplit("\nAnswer: ", 1)[0]
        task, answer = answers[question]
        given = answer if task == "basic_arithmetic" else str(int(answer) + 1)
        ids = tokenizer(f"<answer>{given}</answer>", add_special_tokens=False)["input_ids"]
        return [*ids, tokenizer.eos_token_id]

    run = build_run(cfg)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    run.source.worker.engine = ScriptedEngine(reply, decode=decode)
    run.heldout_accuracy.engine = ScriptedEngine(reply, decode=decode)
    summary = train(run, tmp_path)
    lines = _lines(tmp_path)
    assert {k for r in lines for k in r if k.startswith("reward_mean/")} == {
        f"reward_mean/{t}" for t in TASKS
    }
    for r in lines:
        assert r["heldout_accuracy/basic_arithmetic"] == 1.0
        assert r["heldout_accuracy/chain_sum"] == 0.0
        assert r.get("reward_mean/basic_arithmetic", 1.0) == 1.0
        assert r.get("reward_mean/chain_sum", 0.0) == 0.0
        assert r["reward_errors"] == 0
    assert summary["accuracy_before/basic_arithmetic"] == summary["accuracy_after/basic_arithmetic"]
    assert summary["accuracy_after/basic_arithmetic"] == 1.0
    assert summary["accuracy_after/chain_sum"] == 0.0
    assert summary["reward_mean_last/basic_arithmetic"] == 1.0
    assert summary["reward_mean_last/chain_sum"] == 0.0
    assert 0.0 < summary["accuracy_after"] < 1.0  # the run's own figure mixes the two


@pytest.mark.slow
def test_worker_processes_score_with_the_rows_metadata(model_dir, tmp_path) -> None:
    cfg = _cfg(
        model_dir,
        "pipeline.placement='separate'",
        "pipeline.num_workers=1",
        "train.iterations=1",
        "train.eval_every=0",
    )
    summary = train(build_run(cfg), tmp_path)
    (line,) = _lines(tmp_path)
    assert line["reward_errors"] == 0 and summary["reward_errors"] == 0
    assert any(k.startswith("reward_mean/") for k in line)
