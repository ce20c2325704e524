"""Partial rollouts in the worker's own loop: new weights published between two decode steps
reach the sequences in flight, every token records the version that sampled it, and each stored
behaviour log-prob is the one that version gives the token (the learner's own computation from a
saved copy of its weights, or, with kept keys and values, the forward over them).

The loop runs in a thread as in a worker process; the engine publishes the next version itself
after a chosen decode step (putting the `sync` in the loop's inbox), so the update lands between
the same two steps every run.
"""

import queue
import threading

import pytest
import torch

from cadence.backend import WorkerLoop
from cadence.dataplane import LEARNER, TRAIN, SampleStore, batch_groups, group_rows
from cadence.engine import ContinuousEngine, SamplingParams, ScriptedEngine, load_into
from cadence.envs import SingleTurnEnv
from cadence.rollout import PartialRollouts, RolloutWorker
from cadence.types import Prompt
from inflight import kept_cache_logprobs, learner_logprobs, next_version

SAMPLING = SamplingParams(max_new_tokens=12, temperature=0.9)
QUESTIONS = ["What is 3 + 4?", "Tom has 12 apples. He buys 7 more. How many?"]


class PublishingEngine(ContinuousEngine):
    """Tells `after(n)` when its n-th step is done: where a test publishes new weights."""

    def __init__(self, model, tokenizer, max_num_seqs, after) -> None:
        super().__init__(model, tokenizer, max_num_seqs=max_num_seqs)
        self.after, self.steps = after, 0

    def step(self):
        done = super().step()
        self.steps += 1
        self.after(self.steps)
        return done


def _generate(model, tokenizer, partial, publish, max_num_seqs=4):
    """One task of two prompts x 3 samples through a worker loop whose engine publishes
    `publish = (after_step, version)`; returns the groups (through the sample store, as the
    learner reads them) and the messages the loop sent, in order."""
    versions = {0: model, 1: next_version(model), 2: next_version(model, seed=2)}
    inbox, outbox = queue.Queue(), queue.Queue()
    step, version = publish

    def after(n):
        if n == step:
            inbox.put(("sync", (version, None)))

    engine = PublishingEngine(next_version(model, scale=0.0), tokenizer, max_num_seqs, after)
    worker = RolloutWorker(
        engine,
        tokenizer,
        reward=lambda prompt, response, answer: float(len(response) % 2),
        sampling=SAMPLING,
        group_size=3,
        run_seed=0,
        partial=partial,
    )

    def load(v):
        load_into(engine.model, dict(versions[v].named_parameters()))

    loop = WorkerLoop(0, worker, load, inbox, outbox)
    prompts = [
        Prompt(f"q{i}", f"Question: {q}\nAnswer: ", "7", index=i) for i, q in enumerate(QUESTIONS)
    ]
    inbox.put(("sync", (0, None)))
    inbox.put(("rollout", (0, prompts, 0)))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    messages = [outbox.get(timeout=60)]
    while not (messages[-1][0] == "groups" and messages[-1][2].task_done):
        messages.append(outbox.get(timeout=60))
    if not any(m == ("ack", 0, version) for m in messages):
        messages.append(outbox.get(timeout=60))  # a deferred load: acknowledged once idle
    inbox.put(("stop", None))
    thread.join(timeout=30)
    assert not thread.is_alive()
    groups = [g for kind, _, r in messages if kind == "groups" for g in r.groups]
    return _through_the_store(groups), messages, versions


def _through_the_store(groups):
    store, first = SampleStore(), 0
    for i, g in enumerate(groups):
        rows, fields = group_rows(g, i, first, scored=True)
        store.put(rows, fields)
        first += len(rows)
    batch = store.get(TRAIN, len(groups), LEARNER, timeout=1.0, version=1, max_staleness=1)
    return sorted(batch_groups(batch), key=lambda g: g.prompt.index)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_each_token_has_the_logprob_of_the_version_recorded_for_it(model, tokenizer, kv):
    partial = PartialRollouts(recompute=kv == "recompute")
    groups, messages, versions = _generate(model, tokenizer, partial, publish=(4, 1))
    kinds = [kind for kind, _, _ in messages]
    assert kinds.index("ack") < kinds.index("groups")  # version 1 loaded with sequences in flight
    pad = tokenizer.pad_token_id
    mixed = 0
    for g in groups:
        assert g.policy_version == 0  # the version the group started on
        learner = {v: learner_logprobs(versions[v], g, pad, 0.9) for v in (0, 1)}
        for i, c in enumerate(g.completions):
            stamps = torch.tensor(c.token_versions)  # (T,)
            assert len(stamps) == len(c.token_ids) and set(stamps.tolist()) <= {0, 1}
            mixed += len(set(c.token_versions)) == 2
            stored = torch.tensor(c.logprobs)  # (T,)
            by_version = torch.where(stamps == 0, learner[0][i], learner[1][i])  # (T,)
            if kv == "recompute":  # every token: the learner's, under the version recorded
                torch.testing.assert_close(stored, by_version, atol=1e-5, rtol=0)
                continue
            # kept: the old version's tokens are the learner's under it; the new version's are
            # its weights over the keys and values the old left, not the learner's recomputation
            old = stamps == 0
            torch.testing.assert_close(stored[old], by_version[old], atol=1e-5, rtol=0)
            kept = kept_cache_logprobs(versions, g.prompt_ids, c.token_ids, c.token_versions, 0.9)
            torch.testing.assert_close(stored, kept, atol=1e-5, rtol=0)
            if not old.all():
                assert (stored - by_version)[~old].abs().max() > 1e-4
    assert mixed >= 4  # the four sequences in slots at step 4 spanned both versions


@pytest.mark.parametrize(("max_lag", "spans"), [(None, True), (1, False)])
def test_wait_defers_weights_that_would_make_a_trajectory_too_stale(
    model, tokenizer, max_lag, spans
):
    # version 2 arrives while version-0 sequences decode: two versions behind with a bound of 1
    partial = PartialRollouts(max_lag=max_lag)
    groups, messages, _ = _generate(model, tokenizer, partial, publish=(4, 2))
    versions = {v for g in groups for c in g.completions for v in c.token_versions}
    assert versions == ({0, 2} if spans else {0})
    kinds = [kind for kind, _, _ in messages]
    acked_before_groups = kinds.index("ack", 2) < kinds.index("groups")  # [ready, ack 0, ...]
    assert acked_before_groups == spans


def test_an_engine_without_versions_gives_every_token_the_group_version(tokenizer):
    worker = RolloutWorker(
        ScriptedEngine(lambda ids, seed: [5, 6, 7]),
        tokenizer,
        reward=lambda prompt, response, answer: 1.0,
        sampling=SamplingParams(max_new_tokens=4),
        group_size=2,
        run_seed=0,
    )
    (group,) = worker.rollout([Prompt("p", "1 + 1 = ", "2")], iteration=3, version=3)
    assert [c.token_versions for c in group.completions] == [[3, 3, 3]] * 2


def test_partial_rollouts_need_a_versioned_engine_and_single_turns(model, tokenizer):
    common = dict(reward=None, sampling=SAMPLING, group_size=2, run_seed=0)
    with pytest.raises(ValueError, match=r"rollout\.engine = 'continuous'"):
        engine = ScriptedEngine(lambda ids, seed: [1])
        RolloutWorker(engine, tokenizer, **common, partial=PartialRollouts())
    with pytest.raises(ValueError, match="multi-turn episodes"):
        RolloutWorker(
            ContinuousEngine(model, tokenizer),
            tokenizer,
            **common,
            env=SingleTurnEnv(),
            partial=PartialRollouts(),
        )
