"""The sharded learner's driver: how groups are split among ranks, in rounds, whatever order they
arrive in. The ranks here are recording fakes of `learner.rank.Rank` run in this process
(`backend.ranks.InlineRanks`); the groups come through the real producer and sample store from
worker threads with random delays (`backend.fake.ThreadPool`), and through the Scorer, so they
arrive in a different order every iteration."""

import random
import time
from dataclasses import replace
from typing import ClassVar

import pytest
import torch

from cadence.algo import AlgoParams
from cadence.backend import SharedWeights
from cadence.backend.fake import ThreadPool
from cadence.backend.ranks import InlineRanks
from cadence.builder import check_sharded
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.learner import LearnerParams, Scorer
from cadence.learner.driver import RankedLearner, split_round
from cadence.learner.rank import RoundReply
from cadence.metrics import Tracer
from cadence.pipeline import WorkerSource
from cadence.pipeline.checkpoint import Checkpoint
from cadence.pipeline.checkpoint_files import CheckpointError
from cadence.pipeline.producer import ProducerParams
from cadence.rollout import RolloutWorker
from cadence.types import Completion, Group, Prompt


def _group(uid: str, tokens: int) -> Group:
    return Group(Prompt(uid, "", ""), [0], [Completion([1] * (tokens - 1), [0.0])], 0, 0)


def test_split_round_fills_each_rank_up_to_its_share_balanced_by_tokens():
    rng = random.Random(0)
    for _trial in range(200):
        ranks, per_rank = rng.randint(1, 4), rng.randint(1, 4)
        groups = [
            _group(f"g{i}", rng.randint(2, 40)) for i in range(rng.randint(1, ranks * per_rank))
        ]
        shares = split_round(groups, ranks, per_rank)
        assert len(shares) == ranks
        assert sorted(g.prompt.uid for s in shares for g in s) == sorted(
            g.prompt.uid for g in groups
        )
        assert all(len(s) <= per_rank for s in shares)
        for s in shares:  # each share keeps arrival order
            assert [groups.index(g) for g in s] == sorted(groups.index(g) for g in s)
        # longest first to the lightest rank with room: while every rank has room, no rank ends
        # more than one group's tokens above another
        tokens = [sum(g.num_tokens for g in s) for s in shares]
        if len(groups) <= ranks:
            assert sorted(len(s) for s in shares)[-1] == 1
        elif all(len(s) < per_rank for s in shares):
            assert max(tokens) - min(tokens) <= max(g.num_tokens for g in groups)
    with pytest.raises(ValueError, match="do not fit"):
        split_round([_group("a", 3)] * 5, 2, 2)


class RecordingRank:
    """A `Rank` that trains nothing: it records every call into `log` and answers as a rank
    does."""

    log: ClassVar[list] = []

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def begin(self, version):
        self.log.append(("begin", self.rank, version))

    def train_round(self, groups, step):
        self.log.append(("round", self.rank, [s.group.prompt.uid for s in groups], step))
        self.log.append(("advantages", self.rank, [s.advantages.tolist() for s in groups]))
        figures = None
        if step:
            figures = dict.fromkeys(
                ("loss", "skipped_steps", "tokens_computed", "positions_computed"), 0.0
            )
            figures |= {"num_tokens": 1.0, "forward_passes": 1.0, "micro_batches": 1.0}
        return RoundReply(figures, [], {"peak_rss_mb": 10.0 + self.rank})

    def gather_weights(self):
        self.log.append(("gather", self.rank))

    def save(self, path):
        self.log.append(("save", self.rank, path))
        return {"scheduler": {"last_epoch": 3}, "bad_steps_in_a_row": 0}

    def load(self, path, state):
        self.log.append(("load", self.rank, path, state))

    def describe(self):
        return {"pid": self.rank, "frozen_bytes": 0}

    def close(self):
        pass


def _worker_pool(weights: SharedWeights, seed: int) -> ThreadPool:
    """Two worker threads whose scripted engine answers with 1-8 tokens after a random delay."""

    def make_worker(wid):
        model = torch.nn.Linear(1, 1, bias=False)
        rng = random.Random(seed * 10 + wid)

        def script(ids, sample_seed):
            time.sleep(0.003 * rng.random())
            return [7] * rng.randint(1, 8)

        worker = RolloutWorker(
            ScriptedEngine(script),
            tokenizer=lambda text, add_special_tokens: {"input_ids": [3] * len(text)},
            reward=lambda prompt, response, answer: float(len(response) % 2),
            sampling=SamplingParams(max_new_tokens=8),
            group_size=2,
            run_seed=0,
        )
        return worker, lambda version: load_into(model, weights.tensors)

    return ThreadPool(make_worker, 2, weights)


@pytest.mark.parametrize(
    ("num_ranks", "micro_batch_groups", "mini_batches"), [(2, 2, 1), (3, 1, 1), (2, 3, 2)]
)
def test_every_group_goes_to_exactly_one_rank_whatever_the_arrival_order(
    num_ranks, micro_batch_groups, mini_batches
):
    iterations, per_iteration = 12, 7  # an odd number of groups: the last rounds are partial
    policy = torch.nn.Linear(1, 1, bias=False)
    counter = iter(range(10**6))

    def next_prompts():
        return [
            Prompt(f"p{n}", "x" * (n % 5 + 1), "1", index=i)
            for i, n in zip(range(per_iteration), counter, strict=False)
        ]

    source = WorkerSource(
        _worker_pool(SharedWeights(policy), seed=num_ranks),
        policy,
        Tracer(),
        next_prompts,
        ProducerParams(prompts_per_task=1, tasks_in_flight=2, iterations=iterations),
        stream=True,
    )
    RecordingRank.log = log = []
    ranks = InlineRanks(lambda rank: RecordingRank(rank), num_ranks)
    for r in range(num_ranks):
        ranks.call(r, "build")
    params = LearnerParams(micro_batch_groups=micro_batch_groups, mini_batches=mini_batches)
    learner = RankedLearner(ranks, policy, params)
    scorer = Scorer(AlgoParams())
    arrivals = []
    try:
        for k in range(iterations):
            source.start_iteration(k, learner.version)
            seen = []
            scored = scorer.score(_recorded(source.groups(), seen))
            stats = learner.train_iteration(scored, per_iteration)
            arrivals.append([g.prompt.uid for g in seen])
            assert stats["optimizer_steps"] == mini_batches
            assert stats["learner_ranks"] == num_ranks
            assert stats["learner_rank_peak_rss_mb"] == [10.0 + r for r in range(num_ranks)]
    finally:
        source.close()
    assert len({tuple(a) for a in arrivals}) > 1  # the arrival order really varied
    trained = [uid for e in log if e[0] == "round" for uid in e[2]]
    assert sorted(trained) == sorted(uid for a in arrivals for uid in a)  # each once, none lost
    rounds = [e for e in log if e[0] == "round"]
    for i in range(0, len(rounds), num_ranks):  # every rank takes part in every round, in step
        one = rounds[i : i + num_ranks]
        assert [e[1] for e in one] == list(range(num_ranks))
        assert len({e[3] for e in one}) == 1
        assert all(len(e[2]) <= micro_batch_groups for e in one)
    steps = [e for e in rounds if e[3]]
    assert len(steps) == num_ranks * mini_batches * iterations
    versions = [e[2] for e in log if e[0] == "begin" and e[1] == 0]
    assert versions == list(range(iterations)) and learner.version == iterations


def _recorded(groups, seen):
    for g in groups:
        seen.append(g)
        yield g


def _recording_learner(num_ranks: int) -> RankedLearner:
    ranks = InlineRanks(lambda rank: RecordingRank(rank), num_ranks)
    for r in range(num_ranks):
        ranks.call(r, "build")
    return RankedLearner(ranks, torch.nn.Linear(1, 1), LearnerParams(micro_batch_groups=1))


def test_every_rank_trains_advantages_against_the_baseline_over_all_ranks_groups():
    RecordingRank.log = log = []
    learner = _recording_learner(2)
    scorer = Scorer(AlgoParams(advantage="reinforce"))
    groups = [_group(f"g{i}", 3) for i in range(3)]
    for g, reward in zip(groups, [1.0, 0.0, 0.5], strict=True):
        g.completions[0].reward = reward
    for _ in range(2):
        fresh = [replace(g, policy_version=learner.version) for g in groups]
        learner.train_iteration(scorer.score(fresh), 3)
        scorer.end_iteration()
    trained = [a for e in log if e[0] == "advantages" for group in e[2] for a in group]
    # iteration 0 against 0; iteration 1 against (1 + 0 + 0.5) / 3 = 0.5, whichever rank
    assert trained == pytest.approx([1.0, 0.0, 0.5, 0.5, -0.5, 0.0])
    assert [e[2] for e in log if e[0] == "begin"] == [0, 0, 1, 1]  # every rank, each version


def test_the_drivers_state_is_its_ranks_shards_and_comes_back_through_them(tmp_path):
    RecordingRank.log = log = []
    learner = _recording_learner(2)
    learner.version, learner.bad_steps.in_a_row = 4, 1
    state = learner.state(tmp_path)
    shards = str(tmp_path / "learner")
    assert [e for e in log if e[0] == "save"] == [("save", 0, shards), ("save", 1, shards)]
    assert state["ranks"] == 2 and state["version"] == 4 and state["bad_steps_in_a_row"] == 1
    other = _recording_learner(3)  # any number of ranks reads it
    other.load_state(tmp_path, state)
    loads = [e for e in log if e[0] == "load"]
    assert [e[1] for e in loads] == [0, 1, 2] and {e[2] for e in loads} == {shards}
    assert all(e[3] == state["rank"] for e in loads)
    assert (other.version, other.bad_steps.in_a_row) == (4, 1)
    with pytest.raises(ValueError, match="single-process learner cannot be read"):
        other.load_state(tmp_path, state | {"ranks": 1})


def test_a_checkpoint_is_refused_by_a_learner_that_cannot_read_its_optimizer_state(tmp_path):
    sharded = Checkpoint(tmp_path, {"trainer": {"ranks": 2, "strategy": "fsdp"}})
    with pytest.raises(CheckpointError, match=r"written by 2 learner ranks .* learner.ranks=N"):
        check_sharded(sharded, ranks=1)
    check_sharded(sharded, ranks=3)  # DCP reshards: any number of ranks reads it
    single = Checkpoint(tmp_path, {"trainer": {"ranks": 1, "optimizer": {}, "scheduler": {}}})
    with pytest.raises(CheckpointError, match="single-process learner: resume it with"):
        check_sharded(single, ranks=2)
    check_sharded(single, ranks=1)
