"""The device contract: what a GPU adds (which modules FSDP2 shards, which device a master lives
on, when a copy has landed, what stays resident on GPU 0, in what order a colocated engine
sleeps and wakes) decided by code that runs here, on a CPU, and tested here. Every GPU-path
change meets these tests; each one failed before the fix it holds (docs/ranks.md, docs/scaling.md).
"""

from __future__ import annotations

import socket

import pytest
import torch

from cadence.algo import AlgoParams
from cadence.learner import LearnerParams
from cadence.learner.rank import RankLearner, RankSpec, Rendezvous

pytestmark = pytest.mark.slow


def _rendezvous() -> Rendezvous:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Rendezvous(f"tcp://127.0.0.1:{port}", {"GLOO_SOCKET_IFNAME": "lo"})


def _units(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


@pytest.mark.parametrize(
    "checkpointing, dtype",
    [(False, "float32"), (True, "float32"), (True, "bfloat16")],
    ids=["plain", "checkpointed", "checkpointed-bf16"],
)
def test_fsdp2_shards_every_decoder_layer_of_the_policy_and_the_reference(
    model_dir, tokenizer, checkpointing, dtype
):
    # the 7B recipe's learner: activation checkpointing (layers become Checkpointed<Name>) and
    # mixed precision; every decoder layer is an FSDP unit of its own, besides the root, in the
    # policy and in the frozen reference, or each rank holds whole layers unsharded
    params = LearnerParams(activation_checkpointing=checkpointing, reuse_old_logprobs=False)
    spec = RankSpec(
        str(model_dir), params, AlgoParams(kl_coef=0.01), tokenizer.pad_token_id, 1, dtype=dtype
    )
    rank = RankLearner(0, spec, _rendezvous())
    try:
        layers = rank.model.config.num_hidden_layers
        assert _units(rank.model) == 1 + layers
        assert _units(rank.learner.forward.ref_model) == 1 + layers
        assert _units(rank.learner.forward.old_model) == 1 + layers  # the frozen old copy too
    finally:
        rank.close()


def test_ddp_masters_their_gradients_and_adams_state_live_on_the_parameters_device(model_dir):
    # built on a device other than the one it was loaded on (meta stands for a GPU here): with
    # masters split on the load device, the first gradient collection failed (a CUDA gradient
    # for a CPU master) and AdamW would have stepped CPU masters
    from cadence.learner.rank import replicate
    from cadence.models import load_model

    model, masters = replicate(load_model(model_dir), torch.device("meta"), "bfloat16", "float32")
    assert masters is not None
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert {m.device.type for m in masters.params} == {"meta"}
    assert {m.dtype for m in masters.params} == {torch.float32}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    masters.collect_grads()
    assert {m.grad.device.type for m in masters.params} == {"meta"}
    optimizer = torch.optim.AdamW(masters.params, lr=1e-3)
    optimizer.step()
    moments = [t for state in optimizer.state.values() for k, t in state.items() if k != "step"]
    assert moments and {t.device.type for t in moments} == {"meta"}


def test_rank_0_waits_for_its_copies_into_the_drivers_tensors_before_it_replies(
    model_dir, tokenizer, monkeypatch
):
    # on a GPU the copies into the driver's model are queued: replying before they land would
    # let the driver publish a mix of two versions labelled as the new one
    import cadence.learner.rank as rank_module

    spec = RankSpec(str(model_dir), LearnerParams(), AlgoParams(), tokenizer.pad_token_id, 1)
    from cadence.models import load_model

    driver = load_model(model_dir)
    shared = {n: torch.zeros_like(p) for n, p in driver.named_parameters()}
    rank = RankLearner(0, spec, _rendezvous(), shared=shared)
    seen = []

    def recorded(device):  # what had landed when the rank waited on its device
        landed = all(
            torch.equal(shared[n], p.full_tensor() if hasattr(p, "full_tensor") else p)
            for n, p in rank.model.named_parameters()
        )
        seen.append((device, landed))

    monkeypatch.setattr(rank_module, "synchronize", recorded)
    try:
        assert rank.gather_weights() is None
    finally:
        rank.close()
    assert seen == [(rank.device, True)]  # once, after the last copy, before the reply


def test_synchronize_waits_on_a_gpu_and_on_nothing_else(monkeypatch):
    from cadence.learner import tensors

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    tensors.synchronize(torch.device("cpu"))
    tensors.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_a_reward_model_scores_on_the_runs_device_unless_told_otherwise(monkeypatch):
    # it always scored on the CPU, even in a CUDA run
    from cadence.builder.params import reward_spec
    from cadence.config import load_config
    from cadence.rewards import model as reward_model
    from cadence.rewards.stage import build_batch_scorer

    model = ["reward.kind='model'", "reward.model_path='rm'", "pipeline.placement='separate'"]
    assert reward_spec(load_config(None, model)).device == "cpu"
    cuda = [*model, "model.device='cuda'", "pipeline.num_gpus_per_worker=1"]
    assert reward_spec(load_config(None, cuda)).device == "cuda"
    told = reward_spec(load_config(None, [*cuda, "reward.device='cpu'"]))
    assert told.device == "cpu"
    loaded = []
    monkeypatch.setattr(
        reward_model.RewardModel, "load", classmethod(lambda cls, path, **kw: loaded.append(kw))
    )
    build_batch_scorer(reward_spec(load_config(None, cuda)))
    assert loaded[0]["device"] == "cuda"


class _RecordingLLM:
    """vLLM's `LLM` as the weights' seam meets it: each call recorded in order."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self) -> None:
        self.calls.append(("wake_up",))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        list(kwargs["weights_iterator"])  # consumed, as vLLM's reload does
        self.calls.append(("reload",))

    def apply_model(self, fn) -> None:
        pass

    def reset_prefix_cache(self) -> bool:
        return True


@pytest.mark.parametrize("adapters", [False, True], ids=["whole-weights", "adapters"])
def test_a_colocated_engine_sleeps_level_2_and_returns_torchs_cache_before_it_wakes(
    monkeypatch, adapters
):
    # one sleep -> train -> wake cycle: level 1 copied every weight to host memory and back only
    # for the next sync to overwrite it, and nothing returned PyTorch's cached blocks (the
    # learner's freed memory) before vLLM mapped its own again
    from cadence.engine import vllm_weights

    calls: list = []
    monkeypatch.setattr(vllm_weights, "release_cached_memory", lambda: calls.append(("empty",)))
    weights = vllm_weights.VLLMWeights(
        _RecordingLLM(calls), tensor_parallel=1, lora_rank=8 if adapters else 0, can_sleep=True
    )
    weights.sleep()  # the learner trains meanwhile
    calls.append(("train",))
    if adapters:  # the base weights were kept: a request may wake it
        weights.wake()
        assert calls == [("sleep", 1), ("train",), ("empty",), ("wake_up",)]
        return
    with pytest.raises(RuntimeError, match="woke with its weights gone"):
        weights.wake()  # a request before the next version's weights: refused, not garbage
    weights.load([("w", torch.zeros(1))], busy=False)
    assert calls == [("sleep", 2), ("train",), ("empty",), ("wake_up",), ("reload",)]
    weights.wake()  # loaded since: nothing is lost


def test_the_optimizer_state_exists_before_a_colocated_engine_measures_the_free_memory(
    model_dir, monkeypatch
):
    # vLLM takes its share of the GPU when it starts, against what is free then; AdamW made its
    # moments only at the first step, after, and the learner ran out of memory there
    import cadence.builder.run as run_module
    from cadence.builder import build_run
    from cadence.config import load_config
    from cadence.engine import ScriptedEngine
    from cadence.learner.learner import Learner

    events = []
    allocate = Learner.allocate_state
    monkeypatch.setattr(
        Learner, "allocate_state", lambda self: (events.append("state"), allocate(self))
    )

    def engine(cfg, model, tokenizer):  # what opens vLLM beside the learner
        events.append("engine")
        return ScriptedEngine(lambda ids, seed: [1, 2]), None

    monkeypatch.setattr(run_module, "learner_engine", engine)
    sets = [f"model.path='{model_dir}'", "rollout.engine='vllm'", "data.num_heldout=2"]
    run = build_run(load_config(None, sets))
    try:
        assert events == ["state", "engine"]
        moments = [s["exp_avg"] for s in run.trainer.optimizer.state.values()]
        assert len(moments) == len(list(run.trainer.model.parameters()))
        assert all(not m.any() for m in moments)  # zeros, as AdamW makes them
    finally:
        run.source.close()


def test_moments_made_before_the_first_step_make_the_same_update(model_dir, tokenizer):
    import copy

    from cadence.learner.learner import Learner
    from cadence.models import load_model

    model = load_model(model_dir)
    early, late = (
        Learner(copy.deepcopy(model), LearnerParams(lr=1e-2), AlgoParams(), tokenizer.pad_token_id)
        for _ in range(2)
    )
    early.allocate_state()
    for learner in (early, late):
        for p in learner.model.parameters():
            p.grad = torch.ones_like(p)
        learner.optimizer.step()
    for a, b in zip(early.model.parameters(), late.model.parameters(), strict=True):
        assert torch.equal(a, b)


EIGHT_GPUS = [  # the 8-GPU recipe's placement: 4 ranks on GPUs 0-3, 4 workers on GPUs 4-7
    "model.device='cuda'",
    "learner.ranks=4",
    "pipeline.placement='separate'",
    "pipeline.num_workers=4",
    "pipeline.num_gpus_per_worker=1",
]


def test_with_learner_ranks_the_drivers_copy_stays_in_host_memory(model_dir):
    # GPU 0 held rank 0 and the driver's whole copy beside it (and a shared clone of it) for no
    # pass; the driver's copy is what workers are published and checkpoints saved from
    from cadence.builder.run import load_policy
    from cadence.config import load_config

    model, masters = load_policy(load_config(None, [f"model.path='{model_dir}'", *EIGHT_GPUS]))
    assert {p.device.type for p in model.parameters()} == {"cpu"} and masters is None


def test_evaluation_of_a_host_copy_opens_an_engine_sized_to_its_prompts_and_frees_it(
    model_dir, tokenizer, monkeypatch
):
    # the evaluator's cache (max_num_seqs x (prompt + max_new_tokens) per layer, 37.8 GB in the
    # 8-GPU recipe) was made at the first evaluation and never freed
    import cadence.builder.rollout as rollout_module
    from cadence.builder.rollout import heldout_evaluator
    from cadence.config import load_config
    from cadence.engine import ContinuousEngine
    from cadence.models import load_model
    from cadence.types import Prompt

    cfg = load_config(None, [f"model.path='{model_dir}'", "data.num_heldout=3", *EIGHT_GPUS])
    model = load_model(model_dir)  # in host memory, as the driver holds it
    prompts = [Prompt(f"h{i}", f"{i} + 1 = ", str(i + 1), i) for i in range(3)]
    opened = []
    transient = rollout_module.transient_engine

    def on_cpu(model, tokenizer, slots, device):  # the same engine, on the CPU, recorded
        engine, close = transient(model, tokenizer, slots, "cpu")
        opened.append(engine)
        return engine, lambda: (opened.append("closed"), close())

    monkeypatch.setattr(rollout_module, "transient_engine", on_cpu)
    engine = ContinuousEngine(model, tokenizer)
    evaluator = heldout_evaluator(cfg, model, engine, tokenizer, prompts)
    first = evaluator.results()
    assert len(opened) == 2 and opened[1] == "closed"  # opened, evaluated, closed
    assert opened[0].max_num_seqs == 3 and opened[0].cache is None  # its prompts' slots, freed
    assert opened[0].model is not model  # a copy: the host copy never moves
    assert evaluator.results() == first


def test_an_engine_that_frees_its_cache_after_evaluating_evaluates_the_same(model_dir, tokenizer):
    from cadence.engine import ContinuousEngine, Request, SamplingParams
    from cadence.models import load_model

    engine = ContinuousEngine(load_model(model_dir), tokenizer, max_num_seqs=4)
    requests = [Request([1, 2, 3], [7, 8]), Request([4, 5], [9])]
    params = SamplingParams(max_new_tokens=6)
    first = engine.generate(requests, params)
    assert engine.cache is not None
    engine.release()
    assert engine.cache is None
    again = engine.generate(requests, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
