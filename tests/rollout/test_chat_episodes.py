"""Episodes of chat-format environments (environment classes, OpenEnv): a turn ends at EOS and
the environment reads it, the group is fed the prompt the environment rendered, every episode is
finished exactly once, and the learner trains on exactly the tokens the engine saw, with no
gradient through a token the environment wrote."""

import copy
import json
from pathlib import Path

import pytest
import torch

from cadence.data import ChatRender, Example, to_prompt
from cadence.engine import SamplingParams, ScriptedEngine, derive_seed, derive_turn_seed
from cadence.envs import Budget, EnvReply, EnvSpec, ScriptedEnv, make_env, replies
from cadence.models import load_model, load_tokenizer
from cadence.rollout import RolloutWorker
from cadence.types import Completion
from recording import recording_learner, train

HERMES = (Path(__file__).parents[2] / "configs" / "chat-tools.jinja").read_text()
RUN_SEED, GROUP = 3, 2


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _turns(prompt_index=0, turns=4):
    """Turn seed -> (sample, turn) of one prompt's samples (iteration 0)."""
    return {
        derive_turn_seed(derive_seed(RUN_SEED, 0, prompt_index, j), t): (j, t)
        for j in range(GROUP)
        for t in range(turns)
    }


def _prompt(tokenizer, question="What is 2 + 3?", answer="2 + 3 = 5\n#### 5", index=0):
    render = ChatRender(tokenizer, "{question}", "Use the tools.", HERMES)
    return to_prompt(Example(question, answer), f"rows:{index}", index, render)


class ForcedEngine:
    """Scripted tokens with their true log-probs under `model` given everything before them: what
    a sampling engine would report had it drawn those tokens."""

    owns_weights = False

    def __init__(self, model, tokenizer, script) -> None:
        self.model, self.tokenizer, self.script = model, tokenizer, script
        self.seen: list[tuple[list[int], int]] = []  # (prompt ids, seed) of every request

    @torch.no_grad()
    def generate(self, requests, params: SamplingParams) -> list[list[Completion]]:
        out = []
        for req in requests:
            group = []
            for seed in req.seeds:
                self.seen.append((list(req.prompt_ids), seed))
                ids = self.script(seed)[: req.limit(params)]
                logits = self.model(torch.tensor([req.prompt_ids + ids])).logits[0]  # (P+T, V)
                steps = logits[len(req.prompt_ids) - 1 : -1].float().log_softmax(-1)  # (T, V)
                logprobs = steps.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
                reason = "eos" if ids[-1] in params.stop_token_ids else "length"
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                group.append(Completion(ids, logprobs, text, reason))
            out.append(group)
        return out


def _call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPTS = {  # sample -> its turns, for each kind of environment
    "class": [
        [_call("add", a=2, b=3), "#### 5"],
        [_call("add", a=2, b=3), _call("add", a=1, b=1), "2"],
    ],
    "openenv": [["3", "5"], ["9", "2", "5"]],
}
FACTORIES = {"class": "fixtures_envs:Adder", "openenv": "fixtures_openenv:GuessNumber"}


@pytest.fixture(scope="module")
def sampled(model_dir):
    """(model, tokenizer, {kind: (groups, engine, env)}): one prompt x 2 episodes per kind."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    out = {}
    for kind, turns in SCRIPTS.items():
        table, eos = _turns(), tokenizer.eos_token_id

        def script(seed, turns=turns, table=table, eos=eos):
            j, t = table[seed]
            return [*_encode(tokenizer, turns[j][t]), eos]

        engine = ForcedEngine(model, tokenizer, script)
        spec = EnvSpec(kind, max_turns=4, max_total_tokens=256, factory=FACTORIES[kind])
        env = make_env(EnvSpec(**{**spec.__dict__, "chat_template": HERMES}), tokenizer)
        params = SamplingParams(max_new_tokens=96, stop_token_ids=(eos,))
        reward = lambda prompt, completion, answer: 0.5  # noqa: E731
        worker = RolloutWorker(engine, tokenizer, reward, params, GROUP, RUN_SEED, env=env)
        out[kind] = (worker.rollout([_prompt(tokenizer)], iteration=0, version=0), engine, env)
    return model, tokenizer, out


@pytest.mark.parametrize("kind", ["class", "openenv"])
def test_a_trajectory_is_the_environments_prompt_then_turns_and_template_replies(sampled, kind):
    _, tokenizer, runs = sampled
    (group,), engine, env = runs[kind]
    episode = env.start(_prompt(tokenizer))
    assert group.prompt_ids == _encode(tokenizer, episode.prompt_text)  # the env's rendering
    assert group.prompt_ids != _encode(tokenizer, group.prompt.text)  # not the task's
    table = _turns()
    for j, c in enumerate(group.completions):
        turns = SCRIPTS[kind][j]
        mine = sorted((table[seed][1], ids) for ids, seed in engine.seen if table[seed][0] == j)
        assert [t for t, _ in mine] == list(range(len(turns)))  # every turn went to the engine
        assert c.episode.turns == len(turns) and c.finish_reason == "eos"
        # turn t was prompted with the prompt and every token before it, token for token: it
        # starts where the mask turns back to 1 after the environment's reply
        m = c.loss_mask
        starts = [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]
        assert [len(ids) - len(group.prompt_ids) for _, ids in mine] == starts
        for _, ids in mine:
            assert ids == group.prompt_ids + c.token_ids[: len(ids) - len(group.prompt_ids)]
        # the policy's tokens are its turns (EOS included); the rest are the environment's
        policy = [tok for tok, m in zip(c.token_ids, c.loss_mask, strict=True) if m]
        eos = [tokenizer.eos_token_id]
        assert policy == [x for turn in turns for x in _encode(tokenizer, turn) + eos]
        assert c.episode.env_tokens == c.loss_mask.count(0) > 0
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m)
    if kind == "class":  # the replies are the template's tool role; get_reward scores
        first = group.completions[0]
        reply = env.chat.tool_reply([("add", "5")])
        assert tokenizer.decode(first.token_ids).count("<tool_response>\n5\n</tool_response>") == 1
        assert reply in first.text
        assert [c.reward for c in group.completions] == [1.0, 0.0]  # last sums: 5, then 2
    else:  # the observation answers as the user; rewards sum over the steps
        assert env.chat.user_reply("higher") in group.completions[0].text
        assert [c.reward for c in group.completions] == [1.0, 1.0]


def _learner(model, tokenizer, layout="prefix", **loss):
    return recording_learner(model, tokenizer, layout, 96, **loss)


@pytest.mark.parametrize("kind", ["class", "openenv"])
@pytest.mark.parametrize("layout", ["unpacked", "prefix"])
def test_the_learner_gets_the_engines_logprobs_and_no_gradient_through_the_environment(
    sampled, kind, layout
):
    model, tokenizer, runs = sampled
    groups = copy.deepcopy(runs[kind][0])
    for g in groups:  # spread the rewards so that the advantages, and so the gradients, are not 0
        for j, c in enumerate(g.completions):
            c.reward = float(j)
    learner, rec = _learner(copy.deepcopy(model), tokenizer, layout)
    train(learner, groups)
    for batch, group in zip(rec.batches, groups, strict=True):
        mask = batch.loss_mask.bool()
        want = [c.loss_mask + [0] * (mask.shape[1] - len(c.loss_mask)) for c in group.completions]
        assert torch.equal(mask, torch.tensor(want, dtype=torch.bool))
        diff = (batch.logprobs.detach() - batch.behaviour_logprobs)[mask].abs().max().item()
        assert diff <= 1e-5  # every policy token of every turn, under the env's prompt and replies
        lengths = batch.loss_mask.new_tensor([len(c.token_ids) for c in group.completions])
        env = ~mask & (torch.arange(mask.shape[1]) < lengths[:, None])
        assert env.any()
        assert batch.logprobs.grad[env].abs().max().item() == 0.0  # environment tokens: none
        assert batch.logprobs.grad[mask].abs().max().item() > 0.0


def _worker(tokenizer, env, script, group_size=2):
    engine = ScriptedEngine(
        script, logprob=-0.5, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    )
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,))
    reward = lambda prompt, completion, answer: 0.5  # noqa: E731
    return RolloutWorker(engine, tokenizer, reward, params, group_size, RUN_SEED, env=env)


def test_a_chat_turn_ends_at_eos_and_one_cut_short_ends_the_episode(tokenizer):
    eos = tokenizer.eos_token_id
    env = ScriptedEnv(replies(" R1", " R2"), Budget(4, 100), eos_ends_episode=False)
    (group,) = _worker(tokenizer, env, lambda ids, seed: [40, 41, eos]).rollout(
        [_prompt(tokenizer)], 0, 0
    )
    for c, episode in zip(group.completions, env.episodes, strict=True):
        # every turn ended at EOS and was read; the episode ended when the script said so
        assert c.episode.turns == 3 and len(episode.turns) == 3 and c.finish_reason == "eos"
        assert episode.finished == 1
    cut = ScriptedEnv(replies(" R1"), Budget(4, 100), eos_ends_episode=False)
    (group,) = _worker(tokenizer, cut, lambda ids, seed: [40] * 8).rollout(
        [_prompt(tokenizer)], 0, 0
    )
    for c, episode in zip(group.completions, cut.episodes, strict=True):
        assert c.episode.turns == 1 and episode.turns == [] and c.finish_reason == "length"
        assert episode.finished == 1  # finished, though never asked


def test_the_group_is_fed_the_environments_prompt_and_its_episodes_must_agree(tokenizer):
    seen = []

    def script(ids, seed):
        seen.append(list(ids))
        return [40, tokenizer.eos_token_id]

    own = ScriptedEnv(
        replies(), Budget(2, 50), prompt_text=lambda prompt: f"Rendered: {prompt.uid}\n"
    )
    (group,) = _worker(tokenizer, own, script).rollout([_prompt(tokenizer)], 0, 0)
    assert group.prompt_ids == _encode(tokenizer, "Rendered: rows:0\n")
    assert seen == [group.prompt_ids] * 2
    texts = iter(["one", "two"])
    moody = ScriptedEnv(replies(), Budget(2, 50), prompt_text=lambda prompt: next(texts))
    with pytest.raises(ValueError, match="2 different prompts for the 2 episodes of row rows:0"):
        _worker(tokenizer, moody, script).rollout([_prompt(tokenizer)], 0, 0)


def test_a_reward_the_environment_gives_with_done_comes_before_finish(tokenizer):
    env = ScriptedEnv(
        lambda prompt, turn, text: EnvReply(done=True, reward=0.75),
        Budget(3, 50),
        eos_ends_episode=False,
    )
    (group,) = _worker(tokenizer, env, lambda ids, seed: [40, tokenizer.eos_token_id]).rollout(
        [_prompt(tokenizer)], 0, 0
    )
    assert [c.reward for c in group.completions] == [0.75, 0.75]
    assert [e.finished for e in env.episodes] == [1, 1]
