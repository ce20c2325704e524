"""The fault matrix of weights (docs/reliability.md#weights-you-can-prove): each way an engine can
end up holding other weights than the version it is labelled with, injected, stops the run
within one iteration with an error naming the worker, its engine, the version and the tensors,
before anything is sampled or trained with them; a worker restarted after a death recovers with
the right weights. The workers are in-process threads running the real worker loop
(`backend.fake.ThreadPool`); each sample's first token is the value of the weights it was
sampled with, and version k's weights hold the value k + 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cadence.backend import SharedWeights, WorkerError
from cadence.backend.fake import ThreadPool, WorkerKilled
from cadence.data import ArithmeticTask
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.metrics import Tracer
from cadence.models.fingerprint import WeightMismatch, fingerprint, held
from cadence.pipeline import WorkerSource
from cadence.pipeline.producer import ProducerParams
from cadence.pipeline.prompts import PromptStream
from cadence.rollout import RolloutWorker

ITERATIONS, PER_ITERATION = 3, 4


class Worker:
    """One worker slot's model and its weights' receiver, with the fault to inject."""

    def __init__(self, weights: SharedWeights, fault: str, wid: int, dies: list[int]) -> None:
        self.model = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.model.weight.fill_(1.0)  # version 0's: loaded from the same directory
        self.weights, self.fault, self.wid, self.dies = weights, fault, wid, dies
        self.previous = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def load(self, version: int) -> None:
        if self.fault == "nothing":  # a load that does nothing
            return
        if self.fault == "previous":  # a load of the version before
            load_into(self.model, self.previous)
            self.previous = {n: t.clone() for n, t in self.weights.tensors.items()}
            return
        load_into(self.model, self.weights.tensors)
        if self.fault == "lost" and version >= 1:  # woken with its weights gone
            with torch.no_grad():
                self.model.weight.zero_()

    def script(self, ids, seed):
        if self.dies and self.wid == 0 and seed % 5 == 0:
            self.dies.pop()
            raise WorkerKilled  # the slot's worker dies once; a new one takes its place
        return [int(self.model.weight[0, 0].item()), 1]


def _run(fault: str, restart: str = "", verify: bool = True) -> list[tuple[int, list[int]]]:
    """Periodic with two workers; `fault` injected in every worker's loads (`restart`: only in
    the worker that replaces the one that dies). (version, first tokens) of the groups trained."""
    policy = torch.nn.Linear(4, 4, bias=False)
    weights = SharedWeights(policy)
    dies = [1] if restart else []

    def make_worker(wid):
        worker = Worker(weights, "", wid, dies)
        if not restart or not dies:  # the replacement of a dead worker (or every worker)
            worker.fault = restart or fault
        rollout = RolloutWorker(
            ScriptedEngine(worker.script),
            tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
            reward=lambda prompt, response, answer: float(len(response) % 2),
            sampling=SamplingParams(max_new_tokens=4),
            group_size=2,
            run_seed=0,
        )
        return (
            rollout,
            worker.load,
            lambda expected: held(worker.model.named_parameters(), expected),
        )

    stream = PromptStream(ArithmeticTask(difficulty=1, seed=0), "Q: {question}\nA: ", "a")
    params = ProducerParams(2, 2, iterations=ITERATIONS, group_size=2, max_worker_restarts=1)
    source = WorkerSource(
        ThreadPool(make_worker, 2, weights),
        policy,
        Tracer(),
        lambda: stream.next_batch(PER_ITERATION),
        params,
        stream=True,
        verify=verify,
    )
    trained = []
    try:
        for k in range(ITERATIONS):
            with torch.no_grad():
                policy.weight.fill_(float(k + 1))
            source.start_iteration(k, version=k)
            for g in source.groups():
                trained.append((k, [c.token_ids[0] for c in g.completions]))
    finally:
        source.close()
    return trained


@pytest.mark.parametrize("fault", ["nothing", "previous", "lost"])
def test_a_worker_holding_other_weights_than_its_version_stops_the_run_before_it_samples(fault):
    with pytest.raises(WorkerError) as info:
        _run(fault)
    message = str(info.value)
    assert (
        "WeightMismatch" in message
        and "(fake engine) does not hold the weights of version 1" in message
    )
    assert "1 of the 1 tensors compared differ" in message and "(weight)" in message


def test_unchecked_a_load_that_does_nothing_trains_every_iteration_on_stale_samples():
    # what pipeline.verify_weights = 'off' (and cadence before it) lets through: "on-policy",
    # exit 0, every group after the first iteration sampled with version 0's weights
    trained = _run("nothing", verify=False)
    assert len(trained) == ITERATIONS * PER_ITERATION
    assert all(tokens == [1, 1] for _, tokens in trained)


def test_the_faults_are_faults_the_same_run_without_one_trains_every_iteration():
    trained = _run("")
    assert [k for k, _ in trained] == [k for k in range(ITERATIONS) for _ in range(PER_ITERATION)]
    assert all(tokens == [k + 1] * 2 for k, tokens in trained)  # sampled with version k's


def test_a_worker_restarted_after_a_death_recovers_with_the_right_weights():
    trained = _run("", restart="loads")
    assert all(tokens == [k + 1] * 2 for k, tokens in trained)
    assert len(trained) == ITERATIONS * PER_ITERATION


def test_a_worker_restarted_with_its_initial_weights_stops_the_run():
    with pytest.raises(WorkerError, match="does not hold the weights of version"):
        _run("", restart="nothing")


def test_a_version_counter_that_goes_back_is_refused():
    from cadence.backend import InMemoryWeights
    from cadence.pipeline.gate import WeightGate

    gate = WeightGate(InMemoryWeights(torch.nn.Linear(2, 2)), num_workers=1, timeout_s=5)
    gate.publish(torch.nn.Linear(2, 2), 2, wait=False)
    gate.release(2)
    with pytest.raises(RuntimeError, match="publishes version 1 after releasing 2"):
        gate.publish(torch.nn.Linear(2, 2), 1, wait=False)


def test_a_mismatch_names_the_tensors_that_differ_and_a_cast_copy_is_no_mismatch():
    model = torch.nn.Linear(3, 3)
    expected = fingerprint(model.named_parameters())
    bf16 = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
    assert held(bf16, expected) != expected  # rounded: not what was published
    same_values_other_dtype = {n: p.detach().double() for n, p in model.named_parameters()}
    assert held(same_values_other_dtype, expected) == expected  # cast back to what was published
    with torch.no_grad():
        model.bias.add_(1.0)
    from cadence.models.fingerprint import check

    with pytest.raises(WeightMismatch, match=r"1 of the 2 tensors compared differ .* \(bias\)"):
        check(expected, held(model.named_parameters(), expected), "worker 3 (vllm engine)", 7)


def test_a_checkpoint_whose_trainer_went_back_a_version_is_refused(model, tokenizer, tmp_path):
    from cadence.algo import AlgoParams
    from cadence.learner import FakeTrainer, Scorer
    from cadence.pipeline.checkpoint import (
        RunState,
        find_checkpoint,
        restore_trainer,
        rng_state,
        save_checkpoint,
    )
    from cadence.pipeline.checkpoint_files import CheckpointError

    trainer = FakeTrainer(model)
    trainer.version = 2
    state = RunState(cursor=0, metrics_bytes=0, records=[], accuracy_before=0.0, rng=rng_state())
    save_checkpoint(tmp_path, 2, trainer, Scorer(AlgoParams()), tokenizer, state, keep=2)
    ckpt = find_checkpoint(tmp_path)
    restore_trainer(FakeTrainer(model), ckpt, None)  # as written: it resumes
    ckpt.state["trainer"]["version"] = 1  # a counter gone back (what a failover did elsewhere)
    with pytest.raises(CheckpointError, match="policy version 1, the checkpoint after iteration 2"):
        restore_trainer(FakeTrainer(model), ckpt, None)


class _AdapterEngine(ScriptedEngine):
    """An engine that takes LoRA adapters beside its own base weights (as vLLM does); with
    `ignore` it never applies one (what verl's disaggregated LoRA sync did for two months)."""

    owns_weights = True
    takes_adapters = True

    def __init__(self, ignore: bool = False) -> None:
        super().__init__(lambda ids, seed: [1])
        self.ignore, self.adapter = ignore, {}

    def load_adapter(self, path, version=None) -> None:
        from safetensors.torch import load_file

        from cadence.models.lora import ADAPTER_WEIGHTS

        if not self.ignore:
            self.adapter = fingerprint(load_file(f"{path}/{ADAPTER_WEIGHTS}"))

    def adapter_fingerprint(self):
        return self.adapter


@pytest.mark.parametrize("ignore", [False, True], ids=["applied", "never-applied"])
def test_an_adapter_that_is_never_applied_stops_the_run(model_dir, ignore):
    from cadence.backend.weights import LearnerAdapter
    from cadence.models import load_model
    from cadence.models.lora import LoraSpec, apply_lora

    policy = apply_lora(load_model(model_dir), LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj")))
    sync = LearnerAdapter(_AdapterEngine(ignore), policy)
    if not ignore:
        sync(1)  # the adapter requests carry is the one given: checked, and it is
        return
    with pytest.raises(
        WeightMismatch, match=r"beside the learner: none of the .* tensors of version 1"
    ):
        sync(1)


@pytest.mark.no_learning_gates  # the faulty runs are the point: the gates see them too
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sampler_learner_gap_past_the_dtypes_limit_stops_the_run(
    model_dir, tmp_path, monkeypatch, dtype
):
    # the engine samples at temperature 0.5 while the learner computes the log-probs of the
    # policy at 1.0: another policy than the one trained; the gap was reported in float32 only
    # and nothing acted on it
    import cadence.builder.rollout as rollout_module
    from cadence.pipeline.loop import BehaviourGapError
    from runs import run_config, train_run

    cfg = run_config(model_dir, f"model.dtype='{dtype}'", "algo.kl_coef=0.0")
    train_run(cfg, tmp_path / "right")  # the same run, sampled as trained: within the limit
    sampling = rollout_module.sampling_params
    monkeypatch.setattr(
        rollout_module,
        "sampling_params",
        lambda *a, **kw: dataclasses.replace(sampling(*a, **kw), temperature=0.5),
    )
    with pytest.raises(BehaviourGapError, match=r"iteration 0: .* past 0\.0(01|2)"):
        train_run(cfg, tmp_path / "wrong")
    warn = run_config(model_dir, f"model.dtype='{dtype}'", "pipeline.on_behaviour_gap='warn'")
    assert len(train_run(warn, tmp_path / "warned").records) == 3  # warned, not stopped
