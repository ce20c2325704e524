"""Multi-turn episodes inside a rollout worker, continuously batched with everything else.

An episode alternates between the engine and its environment. Each policy turn is one engine
request whose prompt is the whole episode so far (the task's prompt, then every token already
in the trajectory), seeded by `derive_turn_seed(sample seed, turn)`, so a turn's tokens depend on
nothing but the episode itself. The turn's tokens and behaviour log-probs are appended as they
came out of the engine (`loss_mask` 1); the environment's reply is tokenised once and appended
(`loss_mask` 0, log-prob 0.0). Text is never re-tokenised: the trajectory is exactly the token
sequence the engine saw.

The design in full: docs/internals.md, `cadence/rollout/episodes.py`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from cadence.engine import Request, SamplingParams, StreamingEngine, derive_turn_seed
from cadence.envs import Environment, Episode
from cadence.types import Completion, EpisodeStats

ENV_THREADS = 16  # environment steps in flight at once per worker (tool calls wait in them)
IDLE_WAIT_S = 0.05  # longest wait on a reply while the engine has nothing to decode


@dataclass(eq=False)
class _Group:
    key: Hashable
    prompt_ids: list[int]
    episodes: list[_Episode] = field(default_factory=list)
    remaining: int = 0


@dataclass(eq=False)
class _Episode:
    group: _Group
    sample: int
    seed: int
    env: Episode
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # turn and reply texts, in order
    stats: EpisodeStats = field(default_factory=lambda: EpisodeStats(turns=0))
    finish_reason: str = "length"
    reward: float | None = None  # the environment's own, when it gave one
    asked: float = 0.0  # when its environment was handed the latest turn

    def completion(self) -> Completion:
        return Completion(
            self.token_ids,
            self.logprobs,
            "".join(self.parts),
            self.finish_reason,
            loss_mask=self.loss_mask,
            episode=self.stats,
        )


class Finished(NamedTuple):
    """A group's episodes, ended: their completions and the environment's rewards (None where
    it gave none); `prompt_ids` when the environment rendered the prompt itself (verifiers)."""

    key: Hashable
    completions: list[Completion]
    rewards: list[float | None]
    prompt_ids: list[int] | None = None


class EpisodeRunner:
    """Runs groups of episodes on a streaming engine: `add` a prompt's G episodes, `step` until
    they come back (key, completions, the environment's rewards: None where it gave none)."""

    def __init__(
        self, engine: StreamingEngine, tokenizer, env: Environment, sampling: SamplingParams
    ) -> None:
        self.engine, self.tokenizer, self.env, self.sampling = engine, tokenizer, env, sampling
        self.spans: list[tuple[str, float, float]] = []  # tool calls, for the timeline
        self._groups: dict[Hashable, _Group] = {}
        self._in_engine: dict[Hashable, _Episode] = {}
        self._waiting: dict[cf.Future, _Episode] = {}  # a step in flight
        self._finishing: dict[cf.Future, _Episode] = {}  # a finish in flight
        self._done: list[Finished] = []
        self._pool: cf.ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        return bool(self._groups)

    def add(self, key: Hashable, prompt, prompt_ids: list[int], seeds: list[int]) -> list[int]:
        """Start a prompt's episodes; the prompt ids they are fed (the environment's rendering
        of the prompt where it gives one, else `prompt_ids`). Their first turns share the
        prompt, so an engine that refuses one refuses the first: then nothing of the group is
        left behind."""
        envs = [self.env.start(prompt) for _ in seeds]
        texts = {e.prompt_text for e in envs}
        if len(texts) > 1:
            raise ValueError(
                f"the environment rendered {len(texts)} different prompts for the {len(seeds)} "
                f"episodes of row {prompt.uid}: a group's episodes share one prompt, so reset "
                "must return the same text for every episode of a row (seed it from the row)"
            )
        (text,) = texts
        if text is not None:
            prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        group = _Group(key, list(prompt_ids), remaining=len(seeds))
        try:
            for j, (seed, env) in enumerate(zip(seeds, envs, strict=True)):
                episode = _Episode(group, j, seed, env)
                group.episodes.append(episode)
                self._next_turn(episode)
        except BaseException:  # refused: the episodes never began, let go of what they hold
            for env in envs:
                env.finish()
            raise
        self._groups[key] = group
        return group.prompt_ids

    def step(self) -> list[Finished]:
        self._take_replies()
        if self.engine.busy:
            for key, (completion,) in self.engine.step():
                self._turn_done(self._in_engine.pop(key), completion)
        elif self._waiting or self._finishing:
            pending = [*self._waiting, *self._finishing]
            cf.wait(pending, timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
            self._take_replies()
        done, self._done = self._done, []
        return done

    def _next_turn(self, episode: _Episode) -> None:
        seed = derive_turn_seed(episode.seed, episode.stats.turns)
        room = self.env.budget.max_total_tokens - len(episode.token_ids)
        key = (episode.group.key, episode.sample)
        prompt = episode.group.prompt_ids + episode.token_ids
        self.engine.add(key, Request(prompt, [seed], max_new_tokens=room), self.sampling)
        self._in_engine[key] = episode

    def _turn_done(self, episode: _Episode, turn: Completion) -> None:
        n = len(turn.token_ids)
        episode.token_ids += turn.token_ids
        episode.logprobs += turn.logprobs
        episode.loss_mask += [1] * n
        episode.parts.append(turn.text)
        episode.stats.turns += 1
        episode.finish_reason = turn.finish_reason
        budget = self.env.budget
        if len(episode.token_ids) >= budget.max_total_tokens:
            episode.finish_reason = "length"
        # EOS is the final answer in cadence's syntax; in a chat template it ends every message
        # and only a message the environment can read (ended at EOS) goes on to it
        unread = (turn.finish_reason == "eos") == self.env.eos_ends_episode
        if (
            unread
            or episode.stats.turns >= budget.max_turns
            or len(episode.token_ids) >= budget.max_total_tokens
        ):
            self._finish(episode)
            return
        episode.asked = time.perf_counter()
        self._waiting[self._executor().submit(episode.env.step, turn.text)] = episode

    def _take_replies(self) -> None:
        for future in [f for f in self._finishing if f.done()]:
            episode = self._finishing.pop(future)
            reward = future.result()  # an environment that raises is a bug: the worker fails
            if episode.reward is None:
                episode.reward = reward
            self._close(episode)
        for future in [f for f in self._waiting if f.done()]:
            episode = self._waiting.pop(future)
            reply = future.result()  # an environment that raises is a bug: the worker fails
            stats = episode.stats
            stats.env_s += time.perf_counter() - episode.asked
            stats.tool_calls += reply.tool_calls
            stats.tool_errors += reply.tool_errors
            stats.tool_timeouts += reply.tool_timeouts
            self.spans.extend(reply.spans)
            if reply.done:
                episode.reward = reply.reward
                self._finish(episode)
                continue
            ids = self.tokenizer(reply.text, add_special_tokens=False)["input_ids"]
            if len(episode.token_ids) + len(ids) >= self.env.budget.max_total_tokens:
                episode.finish_reason = "length"  # no room left for the policy to answer
                self._finish(episode)
                continue
            episode.token_ids += ids
            episode.logprobs += [0.0] * len(ids)
            episode.loss_mask += [0] * len(ids)
            episode.parts.append(reply.text)
            stats.env_tokens += len(ids)
            self._next_turn(episode)

    def _finish(self, episode: _Episode) -> None:
        self._finishing[self._executor().submit(episode.env.finish)] = episode

    def _close(self, episode: _Episode) -> None:
        group = episode.group
        group.remaining -= 1
        if group.remaining == 0:
            del self._groups[group.key]
            completions = [e.completion() for e in group.episodes]
            self._done.append(Finished(group.key, completions, [e.reward for e in group.episodes]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="cadence-env")
        return self._pool
