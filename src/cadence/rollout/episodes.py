"""Multi-turn episodes inside a rollout worker, continuously batched with everything else.

An episode alternates between the engine and its environment. Each policy turn is one engine
request whose prompt is the whole episode so far (the task's prompt, then every token already
in the trajectory), seeded by `derive_turn_seed(sample seed, turn)`, so a turn's tokens depend on
nothing but the episode itself. The turn's tokens and behaviour log-probs are appended as they
came out of the engine (`loss_mask` 1); the environment's reply is tokenised once and appended
(`loss_mask` 0, log-prob 0.0). Text is never re-tokenised: the trajectory is exactly the token
sequence the engine saw.

Read on: docs/envs.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from cadence.engine import Request, SamplingParams, StreamingEngine, derive_turn_seed
from cadence.envs import Environment, Episode
from cadence.types import Completion, EpisodeStats

ENV_THREADS = 16  # environment steps in flight at once per worker (tool calls wait in them)
IDLE_WAIT_S = 0.05  # longest wait on a reply while the engine has nothing to decode
ENV_DEADLINE_S = 120.0  # an environment's step or finish still running after this fails the episode


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
    error: str | None = None  # why the environment failed it: reward 0, counted as an error
    asked: float = 0.0  # when its environment was handed the latest turn

    def failed(self, why: str) -> None:
        if self.error is None:  # the first failure is the one that names the cause
            self.error = f"environment: {why}"

    def completion(self) -> Completion:
        return Completion(
            self.token_ids,
            self.logprobs,
            "".join(self.parts),
            self.finish_reason,
            reward_error=self.error,
            loss_mask=self.loss_mask,
            episode=self.stats,
        )

    def env_reward(self) -> float | None:
        """The environment's reward: 0.0 for a failed episode, whose error is counted."""
        if self.reward is not None and not math.isfinite(self.reward):
            self.failed(f"non-finite reward {self.reward}")
        return 0.0 if self.error is not None else self.reward


class Finished(NamedTuple):
    """A group's episodes, ended: their completions and the environment's rewards (None where
    it gave none); `prompt_ids` when the environment rendered the prompt itself (verifiers)."""

    key: Hashable
    completions: list[Completion]
    rewards: list[float | None]
    prompt_ids: list[int] | None = None


class EpisodeRunner:
    """Runs groups of episodes on a streaming engine: `add` a prompt's G episodes, `step` until
    they come back (key, completions, the environment's rewards: None where it gave none).

    An environment that fails an episode (its `step` or `finish` raises, runs past `deadline_s`,
    or gives a non-finite reward) ends that episode only: reward 0 and a `reward_error` naming
    the cause, which the run's error budget counts (reward.max_error_fraction). Every other
    episode goes on."""

    def __init__(
        self,
        engine: StreamingEngine,
        tokenizer,
        env: Environment,
        sampling: SamplingParams,
        deadline_s: float = ENV_DEADLINE_S,
    ) -> None:
        self.engine, self.tokenizer, self.env, self.sampling = engine, tokenizer, env, sampling
        self.deadline_s = deadline_s
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
        if len(episode.token_ids) >= self.env.budget.max_total_tokens:
            episode.finish_reason = "length"  # cut off: nothing the environment could read
            self._finish(episode)
            return
        # EOS is the final answer in cadence's syntax; in a chat template it ends every message
        # and only a message the environment can read (ended at EOS) goes on to it. The last turn
        # env.max_turns allows goes on too: the environment grades it
        if (turn.finish_reason == "eos") == self.env.eos_ends_episode:
            self._finish(episode)
            return
        episode.asked = time.perf_counter()
        self._waiting[self._executor().submit(episode.env.step, turn.text)] = episode

    def _take_replies(self) -> None:
        for future in self._due(self._finishing):
            episode = self._finishing.pop(future)
            reward = self._outcome(future, episode, "finish")
            if episode.reward is None:
                episode.reward = reward
            self._close(episode)
        for future in self._due(self._waiting):
            episode = self._waiting.pop(future)
            reply = self._outcome(future, episode, "step")
            if reply is None:
                self._finish(episode)
                continue
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
            episode.finish_reason = "length"  # unless the next turn ends it otherwise
            if stats.turns >= self.env.budget.max_turns:  # not done after the last turn allowed
                self._finish(episode)
                continue
            ids = self.tokenizer(reply.text, add_special_tokens=False)["input_ids"]
            # no room left for an answer: cut off ("length"), not the environment's failure (an
            # error reply to the policy's own bad call can outgrow a small budget)
            if len(episode.token_ids) + len(ids) >= self.env.budget.max_total_tokens:
                self._finish(episode)
                continue
            episode.token_ids += ids
            episode.logprobs += [0.0] * len(ids)
            episode.loss_mask += [0] * len(ids)
            episode.parts.append(reply.text)
            stats.env_tokens += len(ids)
            self._next_turn(episode)

    def _due(self, running: dict[cf.Future, _Episode]) -> list[cf.Future]:
        """The futures done, or past the deadline (then cancelled: their thread is left to the
        environment, which had it too long)."""
        late = time.perf_counter() - self.deadline_s
        due = []
        for future, episode in running.items():
            if not future.done() and episode.asked < late:
                future.cancel()
                episode.failed(f"no answer within {self.deadline_s:g} s")
            if future.done() or episode.error is not None:
                due.append(future)
        return due

    def _outcome(self, future: cf.Future, episode: _Episode, call: str):
        """What the environment's `call` returned; None when it failed the episode."""
        if episode.error is not None:
            return None
        try:
            return future.result()
        except Exception as e:  # the environment's failure, this episode's alone
            episode.failed(f"{call} raised {type(e).__name__}: {e}")
            return None

    def _finish(self, episode: _Episode) -> None:
        episode.asked = time.perf_counter()
        self._finishing[self._executor().submit(episode.env.finish)] = episode

    def _close(self, episode: _Episode) -> None:
        group = episode.group
        group.remaining -= 1
        if group.remaining == 0:
            del self._groups[group.key]
            rewards = [e.env_reward() for e in group.episodes]
            completions = [e.completion() for e in group.episodes]
            self._done.append(Finished(group.key, completions, rewards))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="cadence-env")
        return self._pool
