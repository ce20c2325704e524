"""The run loop and checkpoints through the seams: source -> staleness -> Scorer -> Trainer, and a
checkpoint saved and restored through `Trainer.state` / `load_state` and the Scorer's state,
with the deterministic fake trainer (no model is trained)."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from cadence.algo import AlgoParams
from cadence.dataplane import StaleRowError
from cadence.learner import FakeTrainer, Scorer
from cadence.metrics import Tracer
from cadence.pipeline.checkpoint import (
    RunState,
    find_checkpoint,
    restore_scorer,
    restore_trainer,
    rng_state,
    save_checkpoint,
)
from cadence.pipeline.checkpoint_files import MANIFEST, CheckpointError
from cadence.pipeline.loop import LoopParams, Run, run_iteration
from cadence.rewards import RewardErrorBudget
from cadence.types import Completion, Group, Prompt, SourceStats


class ListSource:
    """A source whose iterations are given lists of groups; records the versions it was told."""

    def __init__(self, iterations: list[list[Group]]) -> None:
        self.iterations, self.versions = iterations, []

    def start_iteration(self, iteration: int, version: int) -> None:
        self.current = iteration
        self.versions.append(version)

    def groups(self):
        yield from self.iterations[self.current]

    def stats(self) -> SourceStats:
        return SourceStats()

    def close(self) -> None:
        pass


def _group(uid: str, rewards: list[float], version: int) -> Group:
    completions = [Completion([1, 2], [-1.0, -1.0], reward=r, finish_reason="eos") for r in rewards]
    return Group(Prompt(uid, "", ""), [3], completions, version, 0)


def _run(source, trainer, scorer, max_staleness=0) -> Run:
    stream = SimpleNamespace(prompts_skipped=0, prompts_truncated=0, bad_lines_skipped=0)
    params = LoopParams(iterations=2, prompts_per_iteration=2, max_staleness=max_staleness)
    return Run(params, None, trainer, scorer, source, lambda: 0.0, 0, stream, Tracer())


def test_the_loop_scores_what_passed_the_staleness_check_and_trains_on_it():
    scorer = Scorer(AlgoParams(advantage="reinforce"))
    trainer = FakeTrainer(torch.nn.Linear(1, 1))
    source = ListSource(
        [
            [_group("a", [1.0, 0.0], 0), _group("b", [1.0, 1.0], 0)],
            [_group("c", [1.0, 0.0], 1), _group("d", [0.0, 0.0], 1)],
        ]
    )
    run = _run(source, trainer, scorer)
    budget = RewardErrorBudget(0.1)
    first = run_iteration(run, 0, budget)
    second = run_iteration(run, 1, budget)
    assert source.versions == [0, 1]  # the trainer's version starts each iteration
    trained = [[s.group.prompt.uid for s in it] for it in trainer.trained]
    assert trained == [["a", "b"], ["c", "d"]]
    # the scorer's advantages: reinforce against the previous iteration's mean (0 then 0.75)
    advantages = [s.advantages.tolist() for s in trainer.trained[1]]
    assert advantages == [[0.25, -0.75], [-0.75, -0.75]]
    assert first["truncated_frac"] == 0.0 and second["loss"] == pytest.approx(0.625)
    assert scorer.baseline == pytest.approx(0.25)


def test_a_stale_group_never_reaches_the_scorer_or_the_trainer():
    trainer = FakeTrainer(torch.nn.Linear(1, 1))
    trainer.version = 1
    source = ListSource([[], [_group("old", [1.0, 0.0], 0)]])
    run = _run(source, trainer, Scorer(AlgoParams()))
    with pytest.raises(StaleRowError):
        run_iteration(run, 1, RewardErrorBudget(0.1))
    assert trainer.trained == []


def _extra(**kw):
    fields = {"cursor": 0, "metrics_bytes": 0, "records": [], "accuracy_before": 0.0}
    return RunState(**fields, rng=rng_state(), **kw)


def test_a_checkpoint_saves_and_restores_through_the_seams(model, tokenizer, tmp_path):
    pristine = copy.deepcopy(model)
    trainer, scorer = FakeTrainer(model), Scorer(AlgoParams(advantage="reinforce"))
    for k in range(2):
        groups = [_group(f"g{k}", [1.0, float(k)], trainer.version)]
        trainer.train_iteration(scorer.score(groups), 1)
        scorer.end_iteration()
    save_checkpoint(tmp_path, 2, trainer, scorer, tokenizer, _extra(), keep=1)
    ckpt = find_checkpoint(tmp_path)
    restored, rescorer = FakeTrainer(pristine), Scorer(AlgoParams(advantage="reinforce"))
    restore_trainer(restored, ckpt, reference_digest=None)
    restore_scorer(rescorer, ckpt)
    assert restored.version == 2 and rescorer.baseline == scorer.baseline == 1.0
    for (name, p), q in zip(model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(p, q), name  # the policy's weights came back from policy/


def test_a_checkpoint_whose_trainer_state_lacks_a_key_is_refused(model, tokenizer, tmp_path):
    trainer = FakeTrainer(model)
    trainer.state = lambda directory: {"ranks": 1, "bad_steps_in_a_row": 0}  # no version
    save_checkpoint(tmp_path, 1, trainer, Scorer(AlgoParams()), tokenizer, _extra(), keep=1)
    with pytest.raises(CheckpointError, match=r"state.pt lacks trainer.version"):
        find_checkpoint(tmp_path / "checkpoints" / "iter-000001")


def test_a_checkpoint_of_the_previous_format_is_refused_naming_both(model, tokenizer, tmp_path):
    trainer = FakeTrainer(model)
    path = save_checkpoint(tmp_path, 1, trainer, Scorer(AlgoParams()), tokenizer, _extra(), 1)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(manifest | {"format": 2}))
    with pytest.raises(CheckpointError, match=r"checkpoint format 2, not 3: written by another"):
        find_checkpoint(path)
