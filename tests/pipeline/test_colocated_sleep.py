"""Colocated generation on a GPU (issue 40): an engine with its own copy (vLLM) sleeps once an
iteration is generated, so the learner trains with the GPU's memory to itself, and wakes for the
next weight sync; what vLLM is asked for is checked against what the learner left free."""

import pytest

from cadence.builder.params import vllm_options
from cadence.config import ConfigError, load_config
from cadence.engine import Request, SamplingParams
from cadence.engine.vllm import VLLMOptions, check_gpu_memory
from cadence.metrics import Tracer
from cadence.pipeline import ColocatedSource
from cadence.rollout import RolloutWorker
from cadence.types import Completion, Prompt

GiB = 2**30


class SleepyEngine:
    """A streaming engine with its own copy that logs what it is asked, in order, and refuses
    to generate or load while asleep unless it woke first (as VLLMEngine wakes itself)."""

    owns_weights = True

    def __init__(self) -> None:
        self.log: list = []
        self.asleep = False
        self.occupancy: list = []
        self._pending: list[tuple] = []

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def wake(self) -> None:
        if self.asleep:
            self.log.append("wake")
            self.asleep = False

    def load_weights(self, tensors, version=None) -> None:
        self.wake()
        self.log.append(("load", version))

    def add(self, key, request: Request, params: SamplingParams) -> None:
        self.wake()
        self.log.append("add")
        self._pending.append((key, request))

    def step(self):
        done, self._pending = self._pending, []
        return [(key, [Completion([7, 8], [-1.0, -1.0], "ab")] * len(r.seeds)) for key, r in done]

    def sleep(self) -> None:
        assert not self.busy
        self.log.append("sleep")
        self.asleep = True


def test_the_engine_sleeps_while_the_learner_trains_and_wakes_for_the_next_sync():
    engine = SleepyEngine()
    worker = RolloutWorker(
        engine,
        tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
        reward=lambda prompt, response, answer: 1.0,
        sampling=SamplingParams(max_new_tokens=2),
        group_size=2,
        run_seed=0,
    )
    prompts = [Prompt(f"p{i}", f"q{i}", "", i) for i in range(2)]
    source = ColocatedSource(
        worker, Tracer(), lambda: prompts, sync=lambda v: engine.load_weights({}, v)
    )
    for k in range(2):
        source.start_iteration(k, version=k)
        assert engine.asleep  # the learner trains now
        assert len(list(source.groups())) == 2
    assert engine.log == [
        ("load", 0), "add", "add", "sleep",
        "wake", ("load", 1), "add", "add", "sleep",
    ]  # fmt: skip


def test_sleep_mode_is_asked_of_vllm_only_beside_the_learner():
    colocated = vllm_options(load_config(None, ["rollout.engine='vllm'"]))
    assert colocated.sleep_mode and colocated.engine_kwargs("m", "bfloat16", 8)["enable_sleep_mode"]
    separate = vllm_options(
        load_config(None, ["rollout.engine='vllm'", "pipeline.placement='separate'"])
    )
    assert not separate.sleep_mode
    assert "enable_sleep_mode" not in separate.engine_kwargs("m", "bfloat16", 8)
    off = load_config(None, ["rollout.engine='vllm'", "rollout.vllm.sleep_mode=false"])
    assert not vllm_options(off).sleep_mode
    assert not VLLMOptions().sleep_mode


def test_gpu_memory_utilization_beyond_what_the_learner_left_is_refused_naming_the_key():
    check_gpu_memory(0.3, (40 * GiB, 80 * GiB))  # 24 GiB of the 40 free: fits
    with pytest.raises(ConfigError, match=r"rollout.vllm.gpu_memory_utilization = 0.9") as info:
        check_gpu_memory(0.9, (40 * GiB, 80 * GiB))  # 72 GiB asked, 40 free
    assert "set it to 0.48 or less" in str(info.value)
    check_gpu_memory(0.9, None)  # no GPU here: nothing to check
