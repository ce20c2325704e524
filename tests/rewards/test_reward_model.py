"""The learned reward: loading, scoring in micro-batches, clear errors, and the tiny recipe."""

import json
import random

import pytest
import torch

from cadence.cli import main
from cadence.config import ConfigError, load_config
from cadence.data import ArithmeticTask, make_prompt
from cadence.models import ModelLoadError, save_pretrained
from cadence.rewards.model import RewardModel, pad_right, text_ids
from cadence.rewards.model_recipe import (
    build_reward_model,
    heldout_check,
    labelled_pairs,
    train_reward_model,
    wrong_answer,
)

PROMPTS = [make_prompt(q) for q in ["What is 2 + 3?", "What is 9 - 4?", "Tom has 3 pens."]]
RESPONSES = ["2 + 3 = 5\n#### 5", "9 - 4 = 5\n#### 6", "#### 3"]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, model_dir):
    """A random-init two-label classifier sharing the test policy's tokenizer."""
    from cadence.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    out = tmp_path_factory.mktemp("rm") / "reward-model"
    return save_pretrained(build_reward_model("test", tokenizer, seed=0), tokenizer, out)


def test_scores_one_probability_per_pair_the_same_in_any_micro_batching(reward_dir):
    big = RewardModel.load(reward_dir, batch_size=8)
    small = RewardModel.load(reward_dir, batch_size=2)
    prompts, responses = PROMPTS * 2, RESPONSES * 2
    scores = big.score_texts(prompts, responses)
    assert len(scores) == 6 and all(0.0 <= s <= 1.0 for s in scores)
    assert scores[:3] == scores[3:]  # deterministic: the same pair scores the same
    # padding to another batch's width changes nothing: scores agree across micro-batchings
    assert small.score_texts(prompts, responses) == pytest.approx(scores, abs=1e-5)
    # the RewardFn seam scores one response; the reference answer is not shown to the model
    assert big(PROMPTS[0], RESPONSES[0], "#### 6") == pytest.approx(scores[0], abs=1e-6)


def test_ids_and_texts_score_alike_and_the_score_is_the_model_output(reward_dir):
    reward = RewardModel.load(reward_dir)
    pairs = [text_ids(reward.tokenizer, p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    by_ids = reward.score_ids([p for p, _ in pairs], [r for _, r in pairs])
    assert by_ids == reward.score_texts(PROMPTS, RESPONSES)
    ids, attn = pad_right([pairs[0][0] + pairs[0][1]], reward.pad_id)
    with torch.no_grad():
        logits = reward.model(input_ids=ids, attention_mask=attn).logits  # (1, 2)
    assert by_ids[0] == pytest.approx(logits.softmax(-1)[0, 1].item(), abs=1e-6)


def test_a_one_label_model_scores_with_its_regression_output(tmp_path, tokenizer):
    from transformers import LlamaForSequenceClassification

    from cadence.models.presets import llama_config

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(llama_config("test", tokenizer, num_labels=1))
    reward = RewardModel(model, tokenizer)
    ids = tokenizer("What is 1 + 1?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert reward.score_ids([ids[:3]], [ids[3:]]) == [pytest.approx(expected, abs=1e-6)]


def test_missing_or_wrong_directories_are_clear_errors(tmp_path, model_dir, reward_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        RewardModel.load(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM.*not a sequence classifier"):
        RewardModel.load(model_dir)
    config = json.loads((reward_dir / "config.json").read_text())
    config["id2label"] = {str(i): f"l{i}" for i in range(3)}
    (tmp_path / "three").mkdir()
    (tmp_path / "three" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="has 3 labels"):
        RewardModel.load(tmp_path / "three")
    (tmp_path / "three" / "config.json").write_text((reward_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="cannot load weights"):
        RewardModel.load(tmp_path / "three")
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        RewardModel.load(reward_dir).score_texts(PROMPTS[:2], RESPONSES[:1])


def test_reward_kind_model_needs_a_model_path_and_reward_workers():
    separate = 'pipeline.placement="separate"'
    with pytest.raises(ConfigError, match=r"reward\.model_path is required"):
        load_config(None, ['reward.kind="model"', separate])
    cfg = load_config(None, ['reward.kind="model"', 'reward.model_path="runs/rm"', separate])
    assert cfg.reward.kind == "model" and cfg.reward.batch_size == 32
    assert cfg.reward.stage == "separate" and cfg.reward.num_workers == 1  # the kind's default
    default = load_config()
    assert default.reward.kind == "rule" and default.reward.stage == "worker"
    with pytest.raises(ConfigError, match=r"set reward\.stage = 'separate'"):
        load_config(None, ['reward.kind="model"', 'reward.model_path="m"', 'reward.stage="worker"'])
    with pytest.raises(ConfigError, match=r"set pipeline\.placement = 'separate'"):
        load_config(None, ['reward.kind="model"', 'reward.model_path="runs/rm"'])


def test_a_wrong_answer_moves_only_the_final_number_and_stays_natural():
    rng = random.Random(0)
    for final in [0, 1, 7, 42]:
        answer = f"3 + 4 = 7\n#### {final}"
        for _ in range(20):
            wrong = wrong_answer(answer, rng)
            head, _, number = wrong.rpartition("#### ")
            assert head == "3 + 4 = 7\n" and int(number) != final and int(number) >= 0
            assert abs(int(number) - final) <= 3
    assert wrong_answer("#### 2.5", rng) is None


@pytest.mark.slow
def test_the_recipe_tells_correct_from_incorrect_on_held_out_answers(tmp_path, model_dir):
    # Measured at 200 steps: accuracy 0.71, pairwise 0.76 (seeds 1-4 of the task and the
    # recipe: accuracy 0.60-0.94, pairwise 0.75-0.95); chance is 0.5 for both.
    task = ArithmeticTask(difficulty=1, seed=0, max_operand=10, num_heldout=100)
    template = "Question: {question}\nAnswer: "
    figures = train_reward_model(task, template, model_dir, tmp_path / "rm", steps=200)
    assert figures["heldout_accuracy"] >= 0.58 and figures["heldout_pairwise_accuracy"] >= 0.65
    # what was saved is what was checked
    heldout = labelled_pairs(iter(task.heldout()), 100, random.Random(1))
    again = heldout_check(RewardModel.load(tmp_path / "rm"), heldout, template)
    assert again["heldout_accuracy"] == pytest.approx(figures["heldout_accuracy"], abs=0.01)
    recorded = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    assert recorded["heldout_accuracy"] == figures["heldout_accuracy"]


def test_cli_builds_a_loadable_reward_model_and_names_a_missing_tokenizer(tmp_path, model_dir):
    out = tmp_path / "rm"
    args = ["init-reward-model", "--out", str(out), "--tokenizer", str(model_dir), "--steps", "2"]
    assert main(args) == 0
    assert len(RewardModel.load(out).score_texts(PROMPTS, RESPONSES)) == 3
    assert main(args) == 0  # already there: kept
    missing = ["init-reward-model", "--out", str(tmp_path / "x"), "--tokenizer", "nowhere"]
    assert main(missing) == 2
