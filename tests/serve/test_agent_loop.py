"""The documented recipe (examples/agent_loop.py): an external loop that speaks the OpenAI API
drives multi-turn episodes through `cadence serve`, and the learner trains on them token-exactly."""

import copy
import sys
from pathlib import Path

import torch

from cadence.algo import AlgoParams
from cadence.learner import Learner, LearnerParams, score
from cadence.types import Prompt

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import agent_loop


class ChattyAgent(agent_loop.Agent):
    """The random test model never calls a tool: the tool replies to its first two turns."""

    def _tool(self, turn, stats):
        stats.tool_calls += 1
        return "<result>579</result>" if stats.turns < 3 else None


def test_an_external_agent_loop_makes_token_exact_trainable_episodes(served):
    url, tokenizer, model = served
    agent = ChattyAgent(url, api_key="sesame")
    prompt = Prompt("q", "Question: What is 123 + 456?\nAnswer: ", "#### 579", 0)
    group = agent.group(prompt, 3, lambda p, c, a: float(len(c) % 2), seed=5)
    reply = tokenizer("<result>579</result>", add_special_tokens=False)["input_ids"]
    for c in group.completions:
        assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask)
        assert c.episode.turns >= 2 and c.loss_mask.count(0) == len(reply) * (c.episode.turns - 1)
    # what the learner computes for every policy token is what the server sampled it with
    seen = []
    params, algo = LearnerParams(shared_prompt_impl="prefix"), AlgoParams(max_policy_tokens=24)
    learner = Learner(copy.deepcopy(model), params, algo, tokenizer.pad_token_id)
    inner = learner.forward.loss_fn
    learner.forward.loss_fn = lambda batch, p: (seen.append(batch), inner(batch, p))[1]
    learner.train_iteration(iter(score([group], algo)), 1)
    (batch,) = seen
    mask = batch.loss_mask.bool()
    assert mask.sum() < sum(len(c.token_ids) for c in group.completions)  # tool tokens left out
    diff = (batch.logprobs.detach() - batch.behaviour_logprobs)[mask].abs().max().item()
    assert diff <= 1e-5
    assert torch.isfinite(batch.logprobs).all()
