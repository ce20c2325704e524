"""A rollout worker: turns (prompts, group_size, version) into complete, scored groups.

With an environment (cadence.envs) each sample is a multi-turn episode (rollout/episodes.py; a
verifiers environment's own rollouts: rollout/verifiers.py): a group is handed out once its G
episodes have all ended, so `busy` covers every unfinished episode and weights never change
inside one. Without one (`env.kind = "single_turn"`) a sample is one response, exactly as before.
`close` stops what the episodes hold (threads, a verifiers environment's endpoint and servers).

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Protocol

from cadence.engine import (
    Engine,
    InFlightWeights,
    Request,
    SamplingParams,
    Sleeps,
    StreamingEngine,
    as_streaming,
    derive_seed,
)
from cadence.envs import Environment, VerifiersEnv
from cadence.rewards import RewardFn, RewardScorer, as_runner
from cadence.rollout.episodes import Finished
from cadence.rollout.runners import make_episodes
from cadence.rollout.scoring import Job, ScoringLine
from cadence.types import Completion, Group, Prompt


class Episodes(Protocol):
    """What runs a worker's multi-turn episodes on its engine."""

    engine: StreamingEngine
    spans: list[tuple[str, float, float]]

    @property
    def busy(self) -> bool: ...

    def add(
        self, key: Hashable, prompt: Prompt, prompt_ids: list[int], seeds: list[int]
    ) -> list[int]: ...

    def step(self) -> list[Finished]: ...

    def close(self) -> None: ...


def prompt_ids(prompt: Prompt, tokenizer) -> list[int]:
    """The token ids a prompt is fed as: its own where it has them (truncated to fit), else its
    text's. Training and held-out evaluation both come through here."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    return tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


SCORE_WAIT_S = 0.05  # longest wait on scores while the engine has nothing to decode


@dataclass(frozen=True)
class PartialRollouts:
    """New weights taken between decode steps, sequences in flight (pipeline.partial_rollout).

    `recompute`: each sequence in flight is prefilled again under the new weights (AReaL, verl);
    else the keys and values computed under the old ones are kept (PipelineRL). `max_lag`
    (pipeline.staleness_strategy = "wait"): new weights wait, as without partial rollouts, while
    loading them would leave a trajectory in flight whose oldest token is more than `max_lag`
    versions older; None ("drop"): they never wait, and the learner drops what is too stale."""

    recompute: bool = False
    max_lag: int | None = None


class RolloutWorker:
    """`reward`: a reward function (run at its default concurrency, no deadline) or a `RewardScorer`
    (the run's `RewardRunner`: `reward.concurrency`, `reward.timeout_s`; or reward processes
    beside the worker, which it closes with itself); None: a reward stage scores."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        reward: RewardFn | RewardScorer | None,
        sampling: SamplingParams,
        group_size: int,
        run_seed: int,
        env: Environment | VerifiersEnv | None = None,
        partial: PartialRollouts | None = None,
    ) -> None:
        self._jobs: dict[Hashable, Job] = {}  # by (task, position in task)
        self.reward = as_runner(reward) if reward is not None else None
        self._scoring = ScoringLine(self.reward)  # groups generated, in the order they finished
        self.episodes: Episodes | None = None
        if partial is not None and env is not None:
            raise ValueError(
                "partial rollouts take new weights between decode steps of single responses; "
                "multi-turn episodes (env.kind other than 'single_turn') are not supported"
            )
        self.partial = partial
        self._version: int | None = None  # of the weights the engine decodes with
        if env is not None:  # a turn ends at the environment's stop strings too
            missing = tuple(s for s in env.stop if s not in sampling.stop)
            sampling = replace(sampling, stop=sampling.stop + missing)
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.group_size = group_size
        self.run_seed = run_seed
        if env is not None:
            self.episodes = make_episodes(env, self.engine, tokenizer, sampling)

    @property
    def engine(self) -> StreamingEngine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        if self.busy:
            raise RuntimeError("cannot swap the engine of a busy worker")
        if self.partial is not None:
            if not isinstance(engine, InFlightWeights):
                raise ValueError(
                    "partial rollouts need an engine that takes new weights between decode steps "
                    "and stamps each token's version (rollout.engine = 'continuous' or 'vllm'); "
                    f"this engine is a {type(engine).__name__}"
                )
            engine.take_weights_in_flight(self.partial.recompute)
        self._engine = as_streaming(engine)
        if self.episodes is not None:
            self.episodes.engine = self._engine

    @property
    def busy(self) -> bool:
        """Generating or scoring: a group not yet handed out."""
        return bool(self._jobs or self._scoring)

    @property
    def version(self) -> int | None:
        """The version of the weights its engine decodes with (None: not told yet)."""
        return self._version

    def may_load(self, version: int) -> bool:
        """Whether `version`'s weights may be loaded now: while idle, always; while busy, only
        with partial rollouts, and under a lag bound only if no trajectory in flight would then
        have an oldest token more than `max_lag` versions older than `version`."""
        if not self.busy:
            return True
        if self.partial is None:
            return False
        oldest = self._inflight_engine().oldest_version
        lag = self.partial.max_lag
        return lag is None or oldest is None or version - oldest <= lag

    def weights_loaded(self, version: int) -> None:
        """Its engine's weights are now `version`'s (loaded by whoever holds them, when
        `may_load` allowed it): later tokens are stamped with it."""
        if self.busy and self.partial is None:
            raise RuntimeError(f"weights of version {version} loaded into a busy worker")
        self._version = version
        if isinstance(self.engine, InFlightWeights):
            self.engine.weights_changed(version)

    def _inflight_engine(self) -> InFlightWeights:
        assert isinstance(self.engine, InFlightWeights)  # checked when the engine was set
        return self.engine

    def encode(self, prompt: Prompt) -> list[int]:
        return prompt_ids(prompt, self.tokenizer)

    def submit(self, task: Hashable, prompts: list[Prompt], iteration: int, version: int) -> None:
        """Queue `prompts` (one task) for generation with the weights of `version`: those its
        engine decodes with (an idle worker takes `version` as their label: a colocated engine
        decodes the learner's own model, changed in place between iterations)."""
        if version != self._version:
            if self.busy:
                raise RuntimeError(
                    f"a task for version {version} while the engine decodes with {self._version}"
                )
            self.weights_loaded(version)
        now = time.perf_counter()
        for pos, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            seeds = [
                derive_seed(self.run_seed, iteration, prompt.index, j)
                for j in range(self.group_size)
            ]
            if self.episodes is not None:  # the environment may render the prompt itself
                ids = self.episodes.add((task, pos), prompt, ids, seeds)
            else:
                self.engine.add((task, pos), Request(ids, seeds), self.sampling)
            # only once the engine took it: a refused prompt must not leave the worker busy
            self._jobs[(task, pos)] = Job(task, prompt, ids, iteration, version, now)

    def poll(self) -> list[tuple[Hashable, Group]]:
        """One engine step (or, with nothing to decode, a short wait on scores); the (task,
        group) of every group scored since, in the order the groups finished."""
        if self._jobs and self.episodes is not None:
            for done in self.episodes.step():
                if done.prompt_ids is not None:  # the environment rendered the prompt itself
                    self._jobs[done.key].prompt_ids = done.prompt_ids
                self._scoring.add(
                    self._finished(done.key, done.completions), done.completions, done.rewards
                )
        elif self._jobs:
            for key, completions in self.engine.step():
                self._scoring.add(self._finished(key, completions), completions)
        if not self._jobs:
            self._scoring.wait(SCORE_WAIT_S)
        return self._scoring.done()

    def rest(self) -> None:
        """Between generations: an engine that can free the GPU for the learner (vLLM's sleep
        mode) does so until it is next asked to load weights or generate."""
        if isinstance(self._engine, Sleeps) and not self.busy:
            self._engine.sleep()

    def close(self) -> None:
        """Stop what the episodes hold, and the reward's processes if it has any; the worker
        takes no more work."""
        if self.episodes is not None:
            self.episodes.close()
        if self.reward is not None:
            self.reward.close()

    def take_spans(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of the tool calls since the last call (time.perf_counter())."""
        if self.episodes is None:
            return []
        spans, self.episodes.spans = self.episodes.spans, []
        return spans

    def take_occupancy(self) -> list[tuple[float, int]]:
        """(time.perf_counter(), sequences decoding) samples since the last call."""
        samples, self.engine.occupancy = self.engine.occupancy, []
        return samples

    def task_done(self, task: Hashable) -> bool:
        return not any(job.task == task for job in self._jobs.values()) and not (
            self._scoring.holds(task)
        )

    def rollout(self, prompts: list[Prompt], iteration: int, version: int) -> list[Group]:
        """Generate and score `group_size` responses for each prompt; groups in prompt order."""
        if self.busy:
            raise RuntimeError("rollout() needs an idle worker (streamed work is in flight)")
        self.submit(None, prompts, iteration, version)
        done: dict[int, Group] = {}
        while self.busy:
            for _, group in self.poll():
                done[group.prompt.index] = group
        return [done[p.index] for p in prompts]

    def _finished(self, key: Hashable, completions: list[Completion]) -> Job:
        """The job of a group just generated, every token of it stamped with its version."""
        job = self._jobs.pop(key)
        for c in completions:
            self._stamp(c, job.version)
        return job

    def _stamp(self, c: Completion, version: int) -> None:
        """Every token's version: the engine's stamps, which must lie between the version the
        group was submitted with and the newest loaded (one version without partial rollouts);
        an engine that stamps none generated all of it with `version`."""
        if c.token_versions is None:
            c.token_versions = [version] * len(c.token_ids)
            return
        newest = self._version if self._version is not None else version
        if len(c.token_versions) != len(c.token_ids) or not all(
            version <= v <= newest for v in c.token_versions
        ):
            raise RuntimeError(
                f"tokens stamped with versions {sorted(set(c.token_versions))}, outside the "
                f"versions {version}..{newest} loaded while the group was generated"
            )
