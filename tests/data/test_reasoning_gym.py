"""The reasoning-gym task and reward: rows from the real package, seeds, held-out rows that never
reach training, each row scored by its own dataset's `score_answer`, and errors that name the key.
"""

from __future__ import annotations

import pickle
import re
import threading
from itertools import islice

import pytest

from cadence.builder import make_task
from cadence.cli import main
from cadence.config import ConfigError, load_config
from cadence.data import ChatRender, DataError, DatasetChoice, PlainRender, ReasoningGymTask
from cadence.data.base import to_prompt
from cadence.data.reasoning_gym import heldout_mix_seed
from cadence.rewards import load_reward, safe_reward
from cadence.rewards.reasoning_gym import ReasoningGymReward

SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # a few hundred distinct questions
MIX = [DatasetChoice("basic_arithmetic", 1.0, SMALL), DatasetChoice("chain_sum", 1.0, SMALL)]


def _task(**kwargs) -> ReasoningGymTask:
    return ReasoningGymTask(**({"datasets": MIX, "size": 200, "num_heldout": 20} | kwargs))


def _train_questions(task: ReasoningGymTask, n: int) -> list[str]:
    return [e.question for e in islice(task.train_iter(), n)]


def test_rows_are_reasoning_gyms_own_labelled_with_their_dataset() -> None:
    task = _task(seed=3, num_heldout=0)
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(c.name, c.weight, dict(c.config)) for c in MIX]
    own = reasoning_gym.create_dataset("composite", seed=3, size=200, datasets=specs)
    epoch = list(islice(task.train_iter(), 200))  # each row once, in a shuffled order
    assert sorted((e.question, e.answer, e.task) for e in epoch) == sorted(
        (r["question"], r["answer"], r["metadata"]["source_dataset"]) for r in own
    )
    assert all(e.metadata is not None and e.metadata["source_dataset"] == e.task for e in epoch)
    assert {e.task for e in epoch} == {"basic_arithmetic", "chain_sum"}
    assert [e.question for e in epoch] != [r["question"] for r in own]


def test_seeds_fix_the_stream_and_a_resume_continues_it() -> None:
    a, b, other = _task(seed=0), _task(seed=0), _task(seed=1)
    assert _train_questions(a, 300) == _train_questions(b, 300)
    assert _train_questions(a, 50) != _train_questions(other, 50)
    resumed = [e.question for e in islice(a.train_iter(start=170), 60)]
    assert resumed == _train_questions(a, 230)[170:]  # across the epoch boundary too


def test_heldout_rows_never_reach_training() -> None:
    task = _task(size=400, num_heldout=100)
    held = {e.question for e in task.heldout()}
    assert len(held) == len(task.heldout()) > 50  # distinct questions
    assert task.num_overlap > 0  # this small space repeats questions: the filter had work
    assert held.isdisjoint(_train_questions(task, 2 * 400))


def test_heldout_rows_stay_apart_even_beside_the_heldout_seed() -> None:
    """reasoning-gym seeds row i with seed + i: a training seed one off the held-out mix's seed
    draws the held-out rows shifted by one; they are dropped from training all the same."""
    task = _task(seed=heldout_mix_seed(0) + 1, size=100, num_heldout=60)
    held = {e.question for e in task.heldout()}
    assert task.num_overlap >= 50
    assert held.isdisjoint(_train_questions(task, 300))


@pytest.mark.parametrize(("seed", "heldout_seed"), [(0, 0), (1, 0), (0, 1), (2, 1)])
def test_small_seeds_share_no_rows_with_the_heldout_mix(seed, heldout_seed) -> None:
    """With the datasets' wide default configs, questions repeat only when rows do: no training
    row is dropped, so the held-out mix's seed lies far from these training seeds."""
    wide = [DatasetChoice("basic_arithmetic"), DatasetChoice("chain_sum")]
    task = ReasoningGymTask(wide, size=300, seed=seed, num_heldout=100, heldout_seed=heldout_seed)
    assert task.num_overlap == 0 and len(task.heldout()) == 100


def test_heldout_depends_on_data_seed_only() -> None:
    held = [e.question for e in _task(seed=0).heldout()]
    assert held == [e.question for e in _task(seed=7, size=50).heldout()]
    assert held != [e.question for e in _task(heldout_seed=1).heldout()]


def test_prompts_carry_label_and_metadata_and_render_like_any_task(tokenizer) -> None:
    example = _task().heldout()[0]
    prompt = to_prompt(example, "rg:0", 0, PlainRender())
    assert prompt.text == f"Question: {example.question}\nAnswer: "
    assert (prompt.task, prompt.metadata) == (example.task, example.metadata)
    assert pickle.loads(pickle.dumps(prompt)) == prompt
    hash(prompt)  # metadata is left out of the hash
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = _task(developer_prompt="direct").heldout()[0]
    assert system.messages == (("system", SYSTEM_PROMPTS["direct"]), ("user", system.question))
    text = ChatRender(tokenizer)(system)
    assert SYSTEM_PROMPTS["direct"] in text and text.index("direct") < text.index(system.question)
    own = _task(developer_prompt="Reply with a number.").heldout()[0]
    assert own.messages[0] == ("system", "Reply with a number.")
    with pytest.raises(DataError, match="chat_template"):
        PlainRender()(system)


def _entry() -> tuple[str, dict]:
    import reasoning_gym

    row = reasoning_gym.create_dataset("chain_sum", seed=5, size=1)[0]
    return row["answer"], row["metadata"]


def test_reward_is_the_rows_own_score_answer() -> None:
    answer, metadata = _entry()
    reward = ReasoningGymReward()
    right = f"<think>sum it</think> <answer>{answer}</answer>"
    assert reward("q", right, answer, metadata=metadata) == 1.0
    assert reward("q", f"<answer>{int(answer) + 1}</answer>", answer, metadata=metadata) == 0.0
    assert reward("q", f"the answer is {answer}", answer, metadata=metadata) == 0.0  # no tags
    last = f"<answer>0</answer> no, <answer>{answer}</answer>"  # the last tag counts
    assert reward("q", last, answer, metadata=metadata) == 1.0
    # chain_sum's own grader reads numbers: a leading "+" and a trailing ".0" still match
    assert reward("q", f"<answer>+{answer}.0</answer>", answer, metadata=metadata) == 1.0


@pytest.mark.parametrize(
    "name, config, wrong",
    [
        # 6 decimal places and 8 significant digits: an answer off by 8e-4 is wrong; the
        # default grader (fewer digits) called it right
        (
            "decimal_arithmetic",
            {"min_num_decimal_places": 6, "max_num_decimal_places": 6, "precision": 8},
            lambda a: str(float(a) + 8e-4),
        ),
        # 5-letter words: the default grader's word list (4 letters) raised KeyError 5 on every row
        ("word_ladder", {"min_word_length": 5, "max_word_length": 5}, lambda a: "NOT,A,LADDER"),
    ],
)
def test_each_row_is_graded_by_the_dataset_as_configured(name, config, wrong) -> None:
    task = ReasoningGymTask([DatasetChoice(name, 1.0, config)], size=20, seed=1, num_heldout=2)
    reward = ReasoningGymReward()
    for row in islice(task.train_iter(), 3):
        right = f"<answer>{row.answer}</answer>"
        assert reward(row.question, right, row.answer, metadata=row.metadata) == 1.0
        bad = f"<answer>{wrong(row.answer)}</answer>"
        assert reward(row.question, bad, row.answer, metadata=row.metadata) == 0.0


def test_reward_partial_credit_is_the_datasets_own() -> None:
    import reasoning_gym

    row = reasoning_gym.create_dataset("basic_arithmetic", seed=2, size=1)[0]
    grader = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    padded = f"{row['answer']} ok"
    expected = grader(padded, row)
    assert 0.0 < expected < 1.0  # the default grader gives len(oracle) / len(answer)
    tagged = f"<answer>{padded}</answer>"
    got = ReasoningGymReward()("q", tagged, row["answer"], metadata=row["metadata"])
    assert got == pytest.approx(expected, abs=1e-12)


def test_answer_format_picks_the_answer_instead_of_tags() -> None:
    answer, metadata = _entry()
    text = f"so the total is {answer}"
    assert ReasoningGymReward("last_number")("q", text, answer, metadata=metadata) == 1.0
    assert ReasoningGymReward("hashes")("q", f"x\n#### {answer}", answer, metadata=metadata) == 1.0
    assert ReasoningGymReward("boxed")("q", text, answer, metadata=metadata) == 0.0  # no box
    with pytest.raises(ValueError, match="answer_format"):
        ReasoningGymReward("tags")


def test_safe_reward_hands_the_metadata_over_in_any_thread() -> None:
    answer, metadata = _entry()
    fn = load_reward("reasoning_gym", timeout_s=30)  # the run's reward, under a deadline
    right = f"<answer>{answer}</answer>"
    assert safe_reward(fn, "q", right, answer, metadata) == safe_reward(
        ReasoningGymReward(), "q", right, answer, metadata
    )
    assert safe_reward(fn, "q", right, answer, metadata).value == 1.0
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(safe_reward(fn, "q", right, answer, metadata))
    )
    thread.start()
    thread.join()
    assert seen[0].value == 1.0 and seen[0].error is None
    missing = safe_reward(fn, "q", right, answer)  # a row of another task: no metadata
    assert missing.value == 0.0 and "data.task = 'reasoning_gym'" in missing.error


def _cfg(*extra: str):
    return load_config(
        None,
        [
            "data.task='reasoning_gym'",
            "data.num_heldout=10",
            "data.reasoning_gym.size=50",
            "data.reasoning_gym.datasets.chain_sum.weight=1.0",
            *extra,
        ],
    )


def test_config_defaults_to_the_rows_own_reward_and_builds_the_task() -> None:
    cfg = _cfg("train.seed=4")
    assert cfg.reward.function == "reasoning_gym"
    task = make_task(cfg)
    assert task.seed == 4 and len(task.heldout()) == 10
    assert make_task(_cfg("data.reasoning_gym.seed=9")).seed == 9
    assert _cfg("reward.function='math'").reward.function == "math"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("data.reasoning_gym.datasets.nope.weight=1.0", "no dataset 'nope'"),
        ("data.reasoning_gym.datasets.chain_sum.config={ digits = 2 }", "has no key 'digits'"),
        (
            "data.reasoning_gym.datasets.chain_sum.config={ min_terms = 0 }",
            "chain_sum refuses it: AssertionError: min_terms must be positive",
        ),
    ],
)
def test_a_bad_dataset_fails_when_the_task_is_built(extra, message) -> None:
    with pytest.raises(DataError, match=re.escape(message)):
        make_task(_cfg(extra))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("data.reasoning_gym.datasets.chain_sum.weight=0", "weight': Input should be greater"),
        ("data.reasoning_gym.datasets.chain_sum.weight=-1", "greater than 0"),
        ("data.reasoning_gym.datasets.chain_sum.config={ seed = 1 }", "config.seed is set by"),
        ("data.reasoning_gym.datasets.chain_sum.config={ size = 9 }", "config.size is set by"),
        ("data.reasoning_gym.developer_prompt='direct'", "set data.chat_template = true"),
        ("data.difficulty=2", "data.difficulty does not apply"),
        ("data.path='x.jsonl'", "data.path does not apply"),
        ("data.reasoning_gym.size=0", "greater than or equal to 1"),
    ],
)
def test_a_bad_table_is_a_config_error(extra, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(extra)


def test_the_table_and_the_task_go_together() -> None:
    with pytest.raises(ConfigError, match=re.escape("needs a [data.reasoning_gym] table")):
        load_config(None, ["data.task='reasoning_gym'"])
    with pytest.raises(ConfigError, match=re.escape("data.reasoning_gym.datasets")):
        load_config(None, ["data.task='reasoning_gym'", "data.reasoning_gym.size=5"])
    with pytest.raises(ConfigError, match=re.escape("applies to data.task = 'reasoning_gym' only")):
        load_config(None, ["data.reasoning_gym.datasets.chain_sum.weight=1.0"])
    with pytest.raises(ConfigError, match=re.escape("it needs data.task = 'reasoning_gym'")):
        load_config(None, ["reward.function='reasoning_gym'"])
    both = ("data.chat_template=true", "data.system_prompt='x'")
    with pytest.raises(ConfigError, match="set one"):
        _cfg(*both, "data.reasoning_gym.developer_prompt='direct'")


def test_an_unknown_dataset_exits_2_naming_it(model_dir, tmp_path, capsys) -> None:
    config = tmp_path / "rg.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\n[data]\ntask = "reasoning_gym"\n'
        "[data.reasoning_gym.datasets.chain_summ]\nweight = 1.0\n"
    )
    assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no dataset 'chain_summ'; did you mean chain_sum," in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_shipped_config_builds_both_tasks() -> None:
    cfg = load_config("configs/reasoning-gym.toml", ["data.reasoning_gym.size=100"])
    task = make_task(cfg)
    assert {e.task for e in task.heldout()} == {"basic_arithmetic", "chain_sum"}
    assert cfg.reward.function == "reasoning_gym" and cfg.reward.answer_format == "last_number"
