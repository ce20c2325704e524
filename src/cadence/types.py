"""Records that cross a boundary (thread, process, module layer).

Everything here is a plain dataclass of Python scalars, lists and tensors so it can be queued,
pickled to a worker process, or written to JSON. Nothing here imports transformers or does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One task instance: the text the model sees and the reference it is scored against.

    `index` is the prompt's position in its iteration's batch (0..prompts_per_iteration-1); with
    the run seed and the iteration it fixes the sampling seed of every response to this prompt.
    `task` labels the prompt's task within a mix (figures are reported per label); `metadata` is
    the row's own data for a reward that scores with it (a reasoning-gym row's `metadata`, a data
    set row's columns): plain Python values that pickle to worker processes, read-only, left out
    of the hash; an environment class's `reset` gets them too (envs/classes.py).
    """

    uid: str  # stable id of the task instance (dataset name + row, or generator seed)
    text: str  # the full prompt string fed to the tokenizer
    answer: str  # reference answer (GSM8K convention: "... #### 42"; the number after #### counts)
    index: int = 0
    token_ids: tuple[int, ...] | None = None  # set when the text was truncated to fit: use these
    task: str = ""  # the task in a mix ("" for a single task): per-task figures use it
    metadata: dict[str, Any] | None = field(default=None, hash=False)  # the row's, for the reward
    # the conversation a chat prompt was rendered from, (role, content) pairs with the system
    # prompt: an environment that renders the prompt again with its tools starts from it
    messages: tuple[tuple[str, str], ...] = field(default=(), hash=False)


# How `safe_reward` records a call past its deadline: "RewardTimeout: reward 'mod:fn' did not ..."
REWARD_TIMEOUT = "RewardTimeout:"


@dataclass
class EpisodeStats:
    """What one multi-turn episode did besides its tokens (cadence.envs)."""

    turns: int = 1  # policy turns
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, returned something not a string, or were malformed
    tool_timeouts: int = 0  # calls cut off at env.tool_timeout_s
    env_s: float = 0.0  # seconds the episode waited on its environment between turns
    env_tokens: int = 0  # environment tokens in the trajectory (loss_mask 0)


@dataclass
class Completion:
    """One sampled response to a prompt: one turn, or a whole multi-turn trajectory.

    A trajectory's `token_ids` are the tokens the engine saw after the prompt: the policy's turns
    interleaved with the environment's replies. `loss_mask` is 1 on policy tokens (trained, with
    their behaviour log-probs) and 0 on environment tokens (never trained; their `logprobs` are
    0.0). None means every token is the policy's (a single turn).

    `token_versions` is, per token, the policy version whose weights computed the distribution
    it was sampled from (AReaL's `output_versions`): with partial rollouts a sequence that was
    decoding when new weights arrived holds tokens of two or more versions; otherwise every
    token has its group's `policy_version`. None only until the rollout worker stamps it.
    """

    token_ids: list[int]  # response tokens only, EOS included when the model emitted it
    logprobs: list[float]  # behaviour log-prob of each sampled token under the sampling policy
    text: str = ""
    finish_reason: str = "length"  # "eos" | "stop" | "length"
    reward: float = 0.0
    reward_error: str | None = None  # set when the reward function raised or returned NaN
    loss_mask: list[int] | None = None  # per token: 1 policy, 0 environment; None: all policy
    episode: EpisodeStats | None = None  # set for multi-turn episodes
    token_versions: list[int] | None = None  # per token: the policy version that sampled it
    # per token, a distillation teacher's log-prob of it, where a teacher stage scored it
    teacher_logprobs: list[float] | None = None

    @property
    def oldest_version(self) -> int | None:
        """The version of the trajectory's oldest token (None: no token, or not yet stamped)."""
        return min(self.token_versions) if self.token_versions else None

    @property
    def reward_timed_out(self) -> bool:
        """The reward call ran past `reward.timeout_s` (its error names `RewardTimeout`)."""
        return self.reward_error is not None and self.reward_error.startswith(REWARD_TIMEOUT)


@dataclass
class Group:
    """One prompt with its `group_size` responses: the unit that flows from workers to learner."""

    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion]
    policy_version: int  # learner version whose weights generated every completion
    iteration: int  # iteration the group was generated for
    gen_s: float = 0.0  # seconds spent generating (and scoring) this group

    @property
    def group_size(self) -> int:
        return len(self.completions)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def oldest_version(self) -> int:
        """The version of the oldest token of any of its trajectories (what `max_staleness`
        bounds); its `policy_version` where no token is stamped, every token then being of it."""
        stamped = [v for c in self.completions if (v := c.oldest_version) is not None]
        return min(stamped, default=self.policy_version)

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens of every sample, as trained (the TPSPD numerator)."""
        return sum(len(self.prompt_ids) + len(c.token_ids) for c in self.completions)


@dataclass(frozen=True)
class SampleRow:
    """Where one sample sits in the sample store: its identity, its group, its generation.

    `index` is global: unique over the store's life (the producer numbers samples as it creates
    them, so ascending index is arrival order). A group's rows share `group`, `group_size` and
    `iteration`, and have `index_in_group` 0..group_size-1. `policy_version` is fixed when the row
    is created: the producer knows which weights will generate it. `oldest_version` is the
    version of the sample's oldest token, what the staleness rule bounds: newer than
    `policy_version` only with partial rollouts (None: the same).
    """

    index: int
    group: int
    index_in_group: int
    group_size: int
    iteration: int
    policy_version: int
    oldest_version: int | None = None

    @property
    def bounded_version(self) -> int:
        """The version the staleness rule measures: the sample's oldest token's."""
        return self.policy_version if self.oldest_version is None else self.oldest_version


@dataclass
class SampleBatch:
    """What one `SampleStore.get` hands out: rows, and per requested field one value per row."""

    rows: list[SampleRow]
    data: dict[str, list]  # field -> values aligned with `rows`
    num_dropped: int = 0  # rows this get refused as too stale (marked consumed, never returned)
    num_dropped_units: int = 0  # the same, counted in units (groups, or rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class SourceStats:
    """What a group source measured: times of the current iteration (seconds on the tracer's
    clock, from the iteration's start) and counts over the whole run. A snapshot: the source
    goes on without it."""

    start: float = 0.0  # when the iteration started
    weight_sync_s: float = 0.0  # the version barrier: publish, and wait for the workers to load
    weight_sync_bytes: int = 0  # what the version weighed on its way to the engines (0: shared)
    first_group: float = math.nan  # when the iteration's first group arrived
    last_group: float = math.nan  # when its last group arrived
    learner_wait_s: float = 0.0  # the learner's time waiting for groups
    queue_depths: list[int] = field(default_factory=list)  # groups ready, each time it asked
    dropped_groups: int = 0  # refused by the sample store as staler than allowed
    filtered_groups: int = 0  # dynamic sampling: groups with equal rewards, not trained
    oversampled_prompts: int = 0  # dynamic sampling: prompts drawn beyond the iteration's batch
    worker_restarts: int = 0  # workers replaced, over the run
    # stage ("gen", "reward") -> (its workers, samples it finished over the run)
    stages: dict[str, tuple[int, int]] = field(default_factory=dict)
