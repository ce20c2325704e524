"""Held-out evaluation feeds the model what training feeds it."""

import pytest
import torch

from cadence.builder import heldout_evaluator, heldout_set
from cadence.config import load_config
from cadence.engine import SamplingParams, ScriptedEngine
from cadence.rewards import ConstantReward
from cadence.rollout import RolloutWorker, evaluate
from cadence.types import Prompt


def _recording(tokenizer):
    seen: list[list[int]] = []

    def script(ids, seed):
        seen.append(list(ids))
        return [tokenizer.eos_token_id]

    return ScriptedEngine(script), seen


def test_a_prompt_with_its_own_ids_is_fed_those_ids(tokenizer):
    engine, seen = _recording(tokenizer)
    cut = Prompt("p0", "Question: What is 12 + 30?\nAnswer: ", "42", 0, token_ids=(5, 6, 7))
    whole = Prompt("p1", "Question: What is 1 + 2?\nAnswer: ", "3", 1)
    worker = RolloutWorker(engine, tokenizer, ConstantReward(1.0), SamplingParams(4), 1, 0)
    evaluate(worker, [cut, whole])
    assert seen == [[5, 6, 7], tokenizer(whole.text, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("env", ["single_turn", "tool"])
def test_heldout_prompts_cut_to_fit_are_evaluated_as_cut(model_dir, tokenizer, env):
    # before: the text was tokenised again, and evaluation ran on the whole (longer) prompt
    cfg = load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "rollout.max_prompt_tokens=6",
            "rollout.on_long_prompt='truncate'",
            "data.num_heldout=3",
            f"env.kind='{env}'",
        ],
    )
    prompts = heldout_set(cfg, tokenizer, 1024)
    assert len(prompts) == 3 and all(len(p.token_ids or ()) == 6 for p in prompts)
    engine, seen = _recording(tokenizer)
    model = torch.nn.Linear(1, 1)
    heldout_evaluator(cfg, model, engine, tokenizer, prompts)()
    assert seen == [list(p.token_ids) for p in prompts]
