"""An external agent loop that drives multi-turn rollouts through `cadence serve`.

It speaks only the OpenAI API (the `openai` client) and cadence serve's two additions, token ids
in every response and `prompt_token_ids` in the request, so any agent framework that can send
those does the same. For each question it runs G episodes of the calculator task: the policy
writes a turn (stopped at `</call>`), the loop runs the call with its own tool and appends the
result, until the policy answers without a call. Every turn is sent with the exact token ids of
the episode so far (`prompt_token_ids`), and the loop appends the tokens the server sampled and
the tokens `/tokenize` gives for the tool's reply: nothing is re-tokenised, so the trajectory is
token-exact and its log-probs are the server's. The result is a cadence `Group` (policy tokens
with `loss_mask` 1, tool tokens 0) that a `Learner` trains on like any rollout.

    cadence serve runs/sft-calculator &
    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 --questions 4

The tool and the call syntax come from cadence.envs for brevity; any tool would do.
"""

from __future__ import annotations

import argparse

import openai

from cadence.envs import CALL_END, calculator, error_text, parse_call, result_text
from cadence.envs.syntax import MalformedCall
from cadence.types import Completion, EpisodeStats, Group, Prompt


class Agent:
    def __init__(self, base_url: str, model: str = "policy", api_key: str = "none") -> None:
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        self.model = model

    def tokenize(self, text: str) -> list[int]:
        """The server's tokens for `text` (POST /v1/tokenize, as vLLM's /tokenize)."""
        return self.client.post("/tokenize", body={"prompt": text}, cast_to=object)["tokens"]

    def episode(
        self, prompt: Prompt, seed: int, max_turns: int = 3, max_tokens: int = 24
    ) -> Completion:
        """One episode: (turn, tool reply)* then the final turn, as a token-exact trajectory."""
        prompt_ids = self.tokenize(prompt.text)
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        text, stats = "", EpisodeStats(turns=0)
        for turn in range(max_turns):
            choice = self._turn(prompt, prompt_ids + ids, seed + 1000 * turn, max_tokens)
            ids += choice.token_ids
            logprobs += [t.logprob for t in choice.logprobs.content]
            mask += [1] * len(choice.token_ids)
            text += choice.message.content
            stats.turns += 1
            reply = self._tool(choice.message.content, stats)
            if reply is None or turn == max_turns - 1:
                break
            reply_ids = self.tokenize(reply)
            ids += reply_ids
            logprobs += [0.0] * len(reply_ids)
            mask += [0] * len(reply_ids)
            text += reply
            stats.env_tokens += len(reply_ids)
        return Completion(ids, logprobs, text, choice.finish_reason, loss_mask=mask, episode=stats)

    def _turn(self, prompt: Prompt, context: list[int], seed: int, max_tokens: int):
        response = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": prompt.text}],  # for the record: ids rule
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            stop=[CALL_END],
            logprobs=True,
            extra_body={"prompt_token_ids": context, "include_stop_str_in_output": True},
        )
        return response.choices[0]

    def _tool(self, turn: str, stats: EpisodeStats) -> str | None:
        """The tool's reply to the turn's call; None when the turn is the final answer."""
        try:
            call = parse_call(turn)
        except MalformedCall as e:
            stats.tool_calls, stats.tool_errors = stats.tool_calls + 1, stats.tool_errors + 1
            return error_text(str(e))
        if call is None:
            return None
        stats.tool_calls += 1
        name, argument = call
        if name != "calculator":
            stats.tool_errors += 1
            return error_text(f"unknown tool {name!r}")
        try:
            return result_text(calculator(argument))
        except ValueError as e:
            stats.tool_errors += 1
            return error_text(str(e))

    def group(self, prompt: Prompt, group_size: int, reward, seed: int = 0) -> Group:
        """G episodes of one prompt, scored: a group the learner trains on as it is."""
        completions = [self.episode(prompt, seed + 7919 * j) for j in range(group_size)]
        for c in completions:
            c.reward = reward(prompt.text, c.text, prompt.answer)
        prompt_ids = self.tokenize(prompt.text)
        return Group(prompt, prompt_ids, completions, policy_version=0, iteration=0)


def main() -> None:
    from cadence.data import ArithmeticTask, to_prompt
    from cadence.rewards import load_reward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    agent = Agent(args.base_url, api_key=args.api_key)
    task = ArithmeticTask(difficulty=1, max_operand=999, seed=1)
    reward = load_reward("math")
    for i, example in enumerate(task.train_examples(args.questions)):
        group = agent.group(to_prompt(example, f"agent:{i}", i), args.group_size, reward, seed=i)
        print(f"{group.prompt.text!r} (reference {example.answer.splitlines()[-1]})")
        for c in group.completions:
            trained = sum(c.loss_mask)
            print(
                f"  reward {c.reward:.0f}, {c.episode.turns} turns, {trained} policy + "
                f"{len(c.token_ids) - trained} tool tokens: {c.text!r}"
            )


if __name__ == "__main__":
    main()
