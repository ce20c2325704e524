"""The Trainer seam: the one-process learner, the sharded driver and the fake satisfy one
Protocol, and each one's state carries what every trainer's must."""

import torch

from cadence.algo import AlgoParams
from cadence.backend.ranks import BUILD, InlineRanks
from cadence.learner import TRAINER_KEYS, FakeTrainer, Learner, LearnerParams, Trainer, score
from cadence.learner.driver import RankedLearner
from cadence.types import Completion, Group, Prompt


def _scored(version: int = 0):
    completions = [Completion([1, 2], [-1.0, -1.0], reward=float(r)) for r in (0, 1)]
    return score([Group(Prompt("p", "", ""), [3], completions, version, 0)], AlgoParams())


class _Described:
    """A rank that only says what it holds (the driver asks when it is made)."""

    def describe(self):
        return {"pid": 0, "frozen_bytes": 0}


def test_every_trainer_satisfies_the_seam(model, tmp_path):
    learner = Learner(model, LearnerParams(), AlgoParams(), 0)
    transport = InlineRanks(lambda rank: _Described(), 2)
    for r in range(2):
        transport.call(r, BUILD)
    ranked = RankedLearner(transport, torch.nn.Linear(1, 1), LearnerParams())
    fake = FakeTrainer(torch.nn.Linear(1, 1))
    for trainer in (learner, ranked, fake):
        assert isinstance(trainer, Trainer), type(trainer).__name__
    for trainer in (learner, fake):  # the driver's state needs ranks that answer (test_ranks.py)
        state = trainer.state(tmp_path)
        assert set(TRAINER_KEYS) <= state.keys() and state["ranks"] == 1
        assert list(tmp_path.iterdir()) == []  # one process writes no files of its own


def test_the_fake_records_what_it_trained_and_restores_its_version(tmp_path):
    fake = FakeTrainer(torch.nn.Linear(1, 1, bias=False), step=0.5)
    before = fake.model.weight.item()
    stats = fake.train_iteration(iter(_scored()), 1)
    assert fake.version == 1 and [s.group.prompt.uid for s in fake.trained[0]] == ["p"]
    assert stats["num_tokens"] == 2 * (1 + 2) and stats["loss"] > 0
    assert fake.model.weight.item() == before + 0.5
    other = FakeTrainer(torch.nn.Linear(1, 1))
    other.load_state(tmp_path, fake.state(tmp_path))
    assert other.version == 1
