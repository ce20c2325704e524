"""Groups as rows of the sample store, and back: the fields each stage writes and reads.

A finished group becomes `group_size` rows (one per response) with the fields the rollout
workers write; the reward, when a reward stage scores it, arrives later as two more fields. The
learner takes whole groups with every field and gets back the very `Group` records it trained on
before the store existed, and `record_depths` samples how many rows wait for each stage.
Nothing here blocks or holds state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cadence.types import Completion, Group, SampleBatch, SampleRow

if TYPE_CHECKING:
    from cadence.dataplane.store import Store
    from cadence.metrics.trace import Tracer

LEARNER = "learner"  # the store task that trains on whole groups
SCORER = "reward"  # the store task of a reward stage

# Written by a rollout worker (via the producer), one value per response.
GENERATED = (
    "prompt",  # the Prompt record (text, reference answer, uid, position)
    "prompt_ids",
    "response_ids",
    "behaviour_logprobs",
    "token_versions",  # per token, the policy version that sampled it
    "response_text",
    "finish_reason",
    "gen_s",  # seconds the group took to generate (the group's, repeated per row)
    "loss_mask",  # multi-turn: 1 on policy tokens, 0 on environment tokens (None: one turn)
    "episode",  # multi-turn: the episode's EpisodeStats (None: one turn)
)
REWARD = ("reward", "reward_error")  # written by whoever scores: a rollout worker or reward stage
TRAIN = GENERATED + REWARD  # what the learner reads
SCORE = ("prompt", "prompt_ids", "response_ids", "response_text")  # what a reward stage reads
TEACHER = "teacher"  # the store task of a teacher stage (on-policy distillation)
TEACH = ("prompt", "prompt_ids", "response_ids")  # what a teacher stage reads
TEACHER_LOGPROBS = "teacher_logprobs"  # what it writes: per response token, the teacher's


def group_rows(
    group: Group, group_id: int, first_index: int, *, scored: bool
) -> tuple[list[SampleRow], dict[str, list[Any]]]:
    """The rows of `group` (indices `first_index`.., one group id) and their fields; the reward
    fields only if `scored` (the rollout worker computed them)."""
    size = len(group.completions)
    cs = group.completions
    rows = [
        SampleRow(
            first_index + j,
            group_id,
            j,
            size,
            group.iteration,
            group.policy_version,
            cs[j].oldest_version,
        )
        for j in range(size)
    ]
    fields: dict[str, list[Any]] = {
        "prompt": [group.prompt] * size,
        "prompt_ids": [group.prompt_ids] * size,
        "response_ids": [c.token_ids for c in cs],
        "behaviour_logprobs": [c.logprobs for c in cs],
        "token_versions": [c.token_versions for c in cs],
        "response_text": [c.text for c in cs],
        "finish_reason": [c.finish_reason for c in cs],
        "gen_s": [group.gen_s] * size,
        "loss_mask": [c.loss_mask for c in cs],
        "episode": [c.episode for c in cs],
    }
    if scored:
        fields["reward"] = [c.reward for c in cs]
        fields["reward_error"] = [c.reward_error for c in cs]
    return rows, fields


def batch_groups(batch: SampleBatch) -> list[Group]:
    """The groups of a batch taken whole (`groups=True`, every field of `TRAIN`, and a teacher
    stage's `TEACHER_LOGPROBS` where one scores), in its order."""
    by_group: dict[int, list[int]] = {}
    for i, row in enumerate(batch.rows):
        by_group.setdefault(row.group, []).append(i)
    d = batch.data
    groups = []
    for positions in by_group.values():
        positions.sort(key=lambda i: batch.rows[i].index_in_group)
        first = batch.rows[positions[0]]
        completions = [
            Completion(
                token_ids=d["response_ids"][i],
                logprobs=d["behaviour_logprobs"][i],
                text=d["response_text"][i],
                finish_reason=d["finish_reason"][i],
                reward=d["reward"][i],
                reward_error=d["reward_error"][i],
                loss_mask=d["loss_mask"][i],
                episode=d["episode"][i],
                token_versions=d["token_versions"][i],
                teacher_logprobs=d[TEACHER_LOGPROBS][i] if TEACHER_LOGPROBS in d else None,
            )
            for i in positions
        ]
        group = Group(
            d["prompt"][positions[0]],
            d["prompt_ids"][positions[0]],
            completions,
            first.policy_version,
            first.iteration,
        )
        group.gen_s = d["gen_s"][positions[0]]
        groups.append(group)
    return groups


def record_depths(store: Store, tracer: Tracer, reward_stage: bool) -> None:
    """Rows waiting for the learner (in whole ready groups) and, with a reward stage, rows
    waiting to be scored: one "rows waiting" sample each on the tracks "queue-train" and
    "queue-reward" (the stage figures and the timeline read them)."""
    now = time.perf_counter()
    tracer.add_samples(
        "rows waiting", "queue-train", [(now, store.depth(TRAIN, LEARNER, groups=True))]
    )
    if reward_stage:
        waiting = store.depth(SCORE, SCORER)
        tracer.add_samples("rows waiting", "queue-reward", [(now, waiting)])
