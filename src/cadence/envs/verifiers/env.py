"""A verifiers environment seen from cadence: loading it, its tasks as cadence prompts, and its
finished traces as cadence completions.

Read on: docs/envs.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import verifiers.v1 as vf

from cadence.data import DataError, Example
from cadence.data.base import shuffled_epochs
from cadence.imports import load_attribute
from cadence.types import Completion, EpisodeStats, Prompt

TASK_KEY = "verifiers_task"  # Prompt.metadata key: the task's wire data


def load_environment(factory: str) -> vf.Env:
    """The environment `factory` ("module:function") returns; its errors name the fix."""
    fn = load_attribute(factory, "env.factory", "'module:function'")
    if not callable(fn):
        raise ValueError(f"env.factory {factory!r}: {factory.partition(':')[2]!r} is no function")
    env = fn()
    if not isinstance(env, vf.Env):
        raise ValueError(
            f"env.factory {factory!r} returned {type(env).__name__}, not a verifiers.v1.Env: "
            "return vf.load_environment(config) or an Env you built"
        )
    return env


class TasksetTask:
    """The env's taskset as a cadence task: the last `num_heldout` tasks held out (the first of
    an infinite taskset), the rest a shuffled stream, epoch after epoch, seeded like the data
    sets' (`train_iter(k)` resumes after k examples)."""

    num_skipped = 0

    def __init__(self, factory: str, seed: int, num_heldout: int) -> None:
        env = load_environment(factory)
        self.seed = seed
        if type(env.taskset).INFINITE:
            raise DataError(
                f"env.factory {factory!r}: the taskset is infinite; return an env whose taskset "
                "yields a finite list of tasks (cadence shuffles them per epoch)"
            )
        tasks = [_example(task) for task in env.taskset]
        if len(tasks) <= num_heldout:
            raise DataError(
                f"the taskset of env.factory {factory!r} has {len(tasks)} tasks: data.num_heldout"
                f" = {num_heldout} leaves none to train on; lower data.num_heldout"
            )
        self._train, self._heldout = tasks[:-num_heldout], tasks[-num_heldout:]

    def heldout(self) -> list[Example]:
        return list(self._heldout)

    def train_iter(self, start: int = 0) -> Iterator[Example]:
        return shuffled_epochs(self._train, self.seed, start)

    def corpus(self, n: int) -> list[str]:
        return [e.question for e in islice(self.train_iter(), n)]


def _example(task: vf.Task) -> Example:
    data = task.data.model_dump(mode="json")
    return Example(task.data.prompt_text, "", metadata={TASK_KEY: data})


def task_of(env: vf.Env, prompt: Prompt) -> vf.Task:
    """The task a prompt stands for, rebuilt from its wire data with the env's task type."""
    data = (prompt.metadata or {}).get(TASK_KEY)
    if data is None:
        raise ValueError(
            f"prompt {prompt.uid!r} carries no verifiers task: with env.kind = 'verifiers' the "
            "prompts come from the environment's taskset"
        )
    task_type = type(env.taskset).task_type()
    return task_type(task_type.data_type().model_validate(data), env.taskset.config.task)


def group_completions(
    outcomes: list[vf.Trace | str], tokenizer
) -> tuple[list[int] | None, list[Completion], list[float]]:
    """(the group's prompt ids, a completion per outcome, their rewards): the prompt is the
    leading tokens that no trace's model sampled and every trace shares (None when no episode
    left one). An outcome that is a string is a failed episode (why); so is a trace the model
    never sampled in: its completion trains nothing, scores 0 and carries the error."""
    branches: dict[int, vf.Branch] = {}
    failed: dict[int, str] = {}
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, str):
            failed[i] = outcome
            continue
        try:
            branches[i] = _branch(outcome)
        except RuntimeError as e:
            failed[i] = f"verifiers: {e}"
    prompt = None
    if branches:
        kept = list(branches.values())
        prompt = _shared_prompt([b.token_ids for b in kept], [b.sampled_mask for b in kept])
    out = [
        _failed(failed[i], tokenizer)
        if i in failed
        else _completion(outcomes[i], branches[i], len(prompt), tokenizer)
        for i in range(len(outcomes))
    ]
    return prompt, out, [c.reward for c in out]


def _failed(why: str, tokenizer) -> Completion:
    """A failed episode's place in its group: one untrained token, reward 0, the error."""
    return Completion(
        [tokenizer.eos_token_id],
        [0.0],
        finish_reason="stop",
        reward=0.0,
        reward_error=why,
        loss_mask=[0],
        episode=EpisodeStats(turns=0),
    )


def _branch(trace: vf.Trace) -> vf.Branch:
    branches = trace.branches
    if not branches or not any(branches[0].sampled_mask):
        why = trace.last_error.message if trace.last_error else "the model was never called"
        raise RuntimeError(f"a verifiers rollout produced no model turn: {why}")
    if len(branches) > 1:
        raise RuntimeError(
            f"a verifiers rollout forked into {len(branches)} branches: its renderer re-rendered "
            "tokens the model sampled. Use a renderer that extends each turn's tokens "
            "(data.chat_template = false, or a model-specific renderer that bridges turns)"
        )
    return branches[0]


def _shared_prompt(ids: list[list[int]], masks: list[list[bool]]) -> list[int]:
    first = [m.index(True) for m in masks]  # every branch has a sampled token (_branch)
    n = min(first)
    for i in range(n):
        if any(seq[i] != ids[0][i] for seq in ids):
            n = i
            break
    if n == 0:
        raise RuntimeError("the rollouts of a verifiers group share no prompt token")
    return ids[0][:n]


def _completion(trace: vf.Trace, branch: vf.Branch, start: int, tokenizer) -> Completion:
    ids, mask = branch.token_ids[start:], branch.sampled_mask[start:]
    finish = "stop"
    if trace.is_truncated:  # cut off by a limit: never relabelled, whatever its last token
        finish = "length"
    elif ids[-1] == tokenizer.eos_token_id and mask[-1]:
        finish = "eos"
    c = Completion(
        token_ids=ids,
        logprobs=branch.logprobs[start:],
        text=tokenizer.decode(ids),
        finish_reason=finish,
        reward=trace.reward if trace.ok else 0.0,
        loss_mask=[int(m) for m in mask],
        episode=_stats(trace, mask),
    )
    if not trace.ok:
        error = trace.last_error
        c.reward_error = f"verifiers: {error.type}: {error.message}" if error else "verifiers"
    return c


def _stats(trace: vf.Trace, mask: list[bool]) -> EpisodeStats:
    tools = trace.tool_messages
    errors = sum(_text(m.content).lower().startswith("error") for m in tools)
    return EpisodeStats(
        turns=trace.num_turns,
        tool_calls=len(tools),
        tool_errors=errors,
        env_tokens=len(mask) - sum(mask),
    )


def _text(content: Any) -> str:
    return content if isinstance(content, str) else str(content or "")
