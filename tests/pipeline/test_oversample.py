"""Dynamic sampling: the bookkeeping by hand, then the producer over in-thread workers, streaming
and synchronous, drawing the same prompts and training the same groups."""

import random
import time

import pytest
import torch

from cadence.backend import InMemoryWeights
from cadence.backend.fake import ThreadPool
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.metrics import Tracer
from cadence.pipeline import WorkerSource
from cadence.pipeline.oversample import Oversampler, zero_variance
from cadence.pipeline.producer import ProducerParams
from cadence.rollout import RolloutWorker
from cadence.types import Completion, Group, Prompt


def _group(index: int, rewards: list[float]) -> Group:
    completions = [Completion([1], [-1.0], reward=r) for r in rewards]
    return Group(Prompt(f"p{index}", "q", "1", index=index), [0], completions, 0, 0)


def test_zero_variance_means_every_reward_equal():
    assert zero_variance(_group(0, [1.0, 1.0, 1.0]))
    assert zero_variance(_group(0, [0.5]))
    assert not zero_variance(_group(0, [1.0, 1.0, 1.0 + 1e-9]))


def test_each_filtered_group_asks_for_one_more_until_the_batch_is_informative():
    # size 3, budget 5. Arrivals: p1 informative, p0 constant (-> draw p3), p2 informative,
    # p3 constant (-> draw p4), p4 informative. Trained: p1, p2, p4 = 3; drawn 2 extra.
    s = Oversampler(size=3, budget=5)
    assert s.offer(_group(1, [0, 1])) == (True, False)
    assert s.offer(_group(0, [1, 1])) == (False, True)
    assert s.offer(_group(2, [1, 0])) == (True, False)
    assert s.offer(_group(3, [0, 0])) == (False, True)
    assert s.outstanding == 1  # p4 is on its way
    assert s.offer(_group(4, [0, 1])) == (True, False)
    assert s.outstanding == 0 and s.kept == 3 and s.extra == 2
    assert s.top_up() == [] and s.filtered == 2


def test_when_the_budget_runs_out_the_earliest_filtered_groups_fill_the_iteration():
    # size 3, budget 1. p2 constant (-> draw p3), p0 constant (budget spent: held),
    # p1 informative, p3 constant (held). All arrived with 1 informative: top up with the
    # earliest held by position, p0 then p3; none is left untrained.
    s = Oversampler(size=3, budget=1)
    assert s.offer(_group(2, [1, 1])) == (False, True)
    assert s.offer(_group(0, [0, 0])) == (False, False)
    assert s.offer(_group(1, [1, 0])) == (True, False)
    assert s.offer(_group(3, [0, 0])) == (False, False)
    assert s.outstanding == 0
    assert [g.prompt.index for g in s.top_up()] == [0, 3]
    assert s.kept == 3 and s.extra == 1 and s.filtered == 1  # p2 alone stays untrained


def test_disabled_it_passes_every_group_and_a_dropped_group_is_not_replaced():
    s = Oversampler(size=2, budget=4, enabled=False)
    assert s.offer(_group(0, [1, 1])) == (True, False)
    s.forget()  # p1 dropped as too stale
    assert s.outstanding == 0 and s.kept == 1 and s.top_up() == [] and s.filtered == 0


GROUP_SIZE = 3


def _source(stream: bool, budget: int, seed: int = 0):
    """The real producer over two in-thread workers. A prompt whose text length is a multiple of
    3 always scores 1 (a constant group); the others score each sample by its seed's parity, so
    their groups are mostly, not always, informative. Random per-sample delays make groups
    arrive in a different order every run."""
    policy = torch.nn.Linear(1, 1, bias=False)
    weights = InMemoryWeights(policy)
    rng = random.Random(seed)

    def make_worker(wid):
        model = torch.nn.Linear(1, 1, bias=False)

        def script(ids, sample_seed):
            if stream:
                time.sleep(0.003 * rng.random())
            return [sample_seed % 2]

        def reward(prompt, response, answer):
            return 1.0 if len(prompt) % 3 == 0 else float(response == "1")

        worker = RolloutWorker(
            ScriptedEngine(script),
            tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
            reward=reward,
            sampling=SamplingParams(max_new_tokens=4),
            group_size=GROUP_SIZE,
            run_seed=seed,
        )
        return worker, lambda version: load_into(model, weights.tensors)

    examples = iter(range(10**6))
    drawn: list[str] = []

    def make(index):
        n = next(examples)
        drawn.append(f"p{n}")
        return Prompt(f"p{n}", "x" * (n % 7 + 1), "1", index=index)

    source = WorkerSource(
        ThreadPool(make_worker, 2, weights),
        policy,
        Tracer(),
        lambda: [make(i) for i in range(6)],
        ProducerParams(prompts_per_task=2, tasks_in_flight=2, iterations=3, group_size=GROUP_SIZE),
        stream=stream,
        filter_groups=True,
        max_oversample=budget,
        next_extra=make,
    )
    return source, drawn


def _train(stream: bool, budget: int):
    source, drawn = _source(stream, budget)
    trained, stats, topped = [], [], 0
    try:
        for k in range(3):
            source.start_iteration(k, version=k)
            groups = list(source.groups())
            trained.append(sorted(g.prompt.uid for g in groups))
            topped += sum(zero_variance(g) for g in groups)
            stats.append(source.stats())
    finally:
        source.close()
    return trained, stats, drawn, topped


@pytest.mark.parametrize("budget", [64, 2])
def test_streaming_and_sync_draw_the_same_prompts_and_train_the_same_groups(budget):
    sync, sync_stats, sync_drawn, topped = _train(stream=False, budget=budget)
    streamed, streamed_stats, streamed_drawn, _ = _train(stream=True, budget=budget)
    assert streamed == sync and streamed_drawn == sync_drawn
    figures = [(s.filtered_groups, s.oversampled_prompts) for s in sync_stats]
    assert figures == [(s.filtered_groups, s.oversampled_prompts) for s in streamed_stats]
    assert all(len(uids) == 6 for uids in sync)  # every iteration trains the full batch
    assert sum(extra for _, extra in figures) > 0  # some groups really were constant
    for filtered, extra in figures:
        assert extra <= budget
        assert filtered == extra  # trained 6 of 6 + extra drawn: the rest are the filtered
    # with room, only informative groups train; with 2 extra prompts the budget ran out and
    # filtered groups filled an iteration
    assert (topped > 0) == (budget == 2)


def test_with_room_every_trained_group_is_informative():
    source, _ = _source(stream=True, budget=64)
    try:
        for k in range(3):
            source.start_iteration(k, version=k)
            groups = list(source.groups())
            assert len(groups) == 6 and not any(zero_variance(g) for g in groups)
            stats = source.stats()
            assert stats.oversampled_prompts == stats.filtered_groups
    finally:
        source.close()
