"""vLLM as a rollout engine: the StreamingEngine contract over vLLM's own engine (V1, in-process).

The engine runs in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so new weights reach
it as tensors in memory, not pickled through a pipe. vLLM is imported here only, inside
functions: `import cadence` never imports it. How it starts (its options, the checks before, a
start that leaves the process as it found it): engine/vllm_start.py.

Read on: docs/engines.md.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace

from cadence.engine.base import (
    Request,
    RequestRefused,
    SamplingParams,
    Tensors,
    generate_by_steps,
)
from cadence.engine.vllm_logprobs import CHECK_PARAMS, check_full_softmax, hook_sampler
from cadence.engine.vllm_start import (
    INSTALL_HINT,
    VLLMOptions,
    check_gpu_memory,
    on_cpu,
    sleep_mode_available,
    start_llm,
    vllm_available,
)
from cadence.engine.vllm_weights import VLLMWeights
from cadence.types import Completion

__all__ = ["INSTALL_HINT", "VLLMEngine", "VLLMOptions", "check_gpu_memory", "vllm_available"]


@dataclass(eq=False)
class _Job:
    key: Hashable
    completions: list[Completion | None]
    remaining: int
    version: str
    added_under: int | None = None  # the version loaded when it was added (partial rollouts)


class VLLMEngine:
    """`StreamingEngine` over an in-process vLLM engine; see the module docstring.

    `model_path` is a local Hugging Face directory; `tokenizer` is cadence's tokenizer of the
    same directory (it decodes each completion's text, as cadence's engines do). A model vLLM
    cannot load or run is refused at construction with `ModelLoadError` and vLLM's reason.
    """

    owns_weights = True  # its model is vLLM's own copy: new weights arrive by `load_weights`
    _open = False  # vLLM keeps one engine's parallel state per process: one engine at a time

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        max_num_seqs: int = 256,
        dtype: str = "float32",
        options: VLLMOptions | None = None,
    ) -> None:
        if VLLMEngine._open:
            raise RuntimeError(
                "a vLLM engine is already open in this process (vLLM's parallel state is one per "
                "process, and a second engine corrupts the first's): close it first"
            )
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.occupancy: list[tuple[float, int]] = []
        self.version = "initial"  # the weights' label: vLLM stamps each generated token with it
        self.in_flight = False  # new weights may arrive while requests decode (partial rollouts)
        self._number: int | None = None  # the version loaded, as a number (partial rollouts)
        self._jobs: dict[str, tuple[_Job, int]] = {}  # vLLM request id -> (job, sample)
        options = options or VLLMOptions()
        self._ids = itertools.count()
        check_gpu_memory(options.gpu_memory_utilization)
        # vLLM refuses enable_sleep_mode where it has none (CPU): asked there, nothing happens
        options = replace(options, sleep_mode=options.sleep_mode and sleep_mode_available())
        cpu = on_cpu()
        if cpu and options.tensor_parallel_size > 1:  # vLLM binds each worker to a NUMA node
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kwargs = options.engine_kwargs(model_path, dtype, max_num_seqs, cpu=cpu)
        self.llm = start_llm(model_path, kwargs)
        VLLMEngine._open = True
        self.weights = VLLMWeights(
            self.llm,
            tensor_parallel=options.tensor_parallel_size,
            lora_rank=options.lora_rank,
            can_sleep=options.sleep_mode,
        )
        self.runners: list[str] = []  # the model runner of each vLLM worker: "v1" or "v2"
        self._set_version(self.version)
        self._warm_up(model_path)

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def takes_adapters(self) -> bool:
        return self.weights.takes_adapters

    @property
    def can_sleep(self) -> bool:
        return self.weights.can_sleep

    @property
    def asleep(self) -> bool:
        return self.weights.asleep

    @property
    def version_bytes(self) -> int:
        """Tensor parallel: the bytes of the last version's files."""
        return self.weights.version_bytes

    @property
    def max_model_len(self) -> int:
        """The most positions (prompt and response) a request may take."""
        return self.llm.llm_engine.model_config.max_model_len

    def add(self, key: Hashable, request: Request, params: SamplingParams) -> None:
        """Queue the request's samples; a request vLLM refuses raises `RequestRefused`, with
        none of its samples left in the engine (the job is registered only once all are in)."""
        if not request.seeds:
            raise ValueError("a request needs at least one seed")
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input

        # salted with the weights' load: a prefix-cache block computed under other weights
        # never matches (with requests in flight vLLM cannot empty its cache at a load)
        self.wake()
        prompt = tokens_input(list(request.prompt_ids), cache_salt=self.weights.cache_salt)
        limit = request.limit(params)  # an episode's turn: the room its budget leaves
        added: list[str] = []
        try:
            for seed in request.seeds:
                rid = str(next(self._ids))
                vparams = _vllm_params(params, seed, limit)
                adapter = self.weights.adapter
                self.llm.llm_engine.add_request(rid, prompt, vparams, lora_request=adapter)
                added.append(rid)
        except BaseException as e:
            if added:
                self.llm.llm_engine.abort_request(added)
            if isinstance(e, VLLMClientError | ValueError):
                raise RequestRefused(
                    f"vLLM refused a request with a prompt of {len(request.prompt_ids)} tokens "
                    f"(max_model_len {self.max_model_len}): {e}"
                ) from e
            raise
        job = _Job(key, [None] * len(added), len(added), self.version, self._number)
        for j, rid in enumerate(added):
            self._jobs[rid] = (job, j)

    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        """One vLLM engine step; the (key, completions) of every request it finished."""
        if not self._jobs:
            return []
        done = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            job, j = self._jobs.pop(out.request_id)
            job.completions[j] = self._completion(out.outputs[0], job.version)
            job.remaining -= 1
            if job.remaining == 0:
                done.append((job.key, job.completions))
        num = min(self.llm.llm_engine.get_num_unfinished_requests(), self.max_num_seqs)
        self.occupancy.append((time.perf_counter(), num))
        return done

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        return generate_by_steps(self, requests, params)

    def load_weights(self, tensors: Tensors, version: int | str | None = None) -> None:
        """Put new weights (Hugging Face parameter names) into the running model, in place;
        with requests decoding only once `take_weights_in_flight` allowed it."""
        if self.busy and not self.in_flight:
            raise RuntimeError("load_weights while requests decode: one would see two versions")
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        self.weights.load(items, self.busy)
        self._loaded(version)

    def held_fingerprint(self, expected: dict) -> dict:
        """What its copy holds now (engine/vllm_weights.py), for the tensors `expected` names."""
        return self.weights.held_fingerprint(expected)

    def adapter_fingerprint(self) -> dict:
        """The adapter later requests decode with, as vLLM read it ({}: none)."""
        return self.weights.adapter_fingerprint

    def load_adapter(self, path: str, version: int | str | None = None) -> None:
        """Decode every later request with the LoRA adapter saved in `path` (peft's layout) on
        the base weights the engine holds: vLLM reads it before this returns, and the adapter
        before it is dropped. Only while idle, as `load_weights`; needs `options.lora_rank`."""
        if self.busy:
            raise RuntimeError("load_adapter while requests decode: one would see two versions")
        self.weights.load_adapter(path)
        self._loaded(version)

    def _loaded(self, version: int | str | None) -> None:
        """Label the weights just loaded (or the adapter): `version`, or a fresh label."""
        self._set_version(str(version) if version is not None else f"load-{next(self._ids)}")
        self._number = version if isinstance(version, int) else None

    def sleep(self) -> None:
        """While idle and where vLLM can (a GPU, `sleep_mode`): level 1, its weights to host
        memory and its KV cache freed, until the next `load_weights` or `add` wakes it."""
        if not self.busy:
            self.weights.sleep()

    def wake(self) -> None:
        """Take back what `sleep` freed (its weights and KV cache), if asleep."""
        self.weights.wake()

    def take_weights_in_flight(self, recompute: bool) -> None:
        """Allow new weights between two steps while requests decode, keeping their keys and
        values; prefilling them again (`recompute`) is not offered."""
        if recompute:
            raise ValueError(
                "the vLLM engine keeps the keys and values of the requests in flight when new "
                "weights arrive: use pipeline.partial_rollout_kv = 'keep' with rollout.engine = "
                "'vllm' ('recompute' needs rollout.engine = 'continuous')"
            )
        self.in_flight = True

    @property
    def oldest_version(self) -> int | None:
        """The oldest version a request in flight was added under (its tokens are that version
        or newer: vLLM reports them only once a request finishes)."""
        versions = [job.added_under for job, _ in self._jobs.values()]
        return min((v for v in versions if v is not None), default=None)

    def weights_changed(self, version: int) -> None:
        """The weights loaded are `version`'s (`load_weights` labelled them already, or they
        are the model's own)."""
        self._number = version
        if self.version != str(version):
            self._set_version(str(version))

    def close(self) -> None:
        """Shut the engine down and release what vLLM set up in this process (its
        torch.distributed group and parallel state): another engine may start after. The LLM
        is dropped first, so that the collection its shutdown ends with (a second one costs
        about a second in a large process) frees it too."""
        core = self.llm.llm_engine.engine_core
        del self.llm
        core.shutdown()  # vLLM's cleanup_dist_env_and_memory: parallel state, gc.collect()
        VLLMEngine._open = False

    def _completion(self, out, version: str) -> Completion:
        ids = list(out.token_ids)
        spans = [(s.version, s.start, s.end) for s in out.weight_versions or []]
        versions = None
        if self.in_flight:
            versions = _token_versions(spans, len(ids))
        elif ids and spans != [(version, 0, len(ids))]:
            raise RuntimeError(f"a sample generated under weights {spans}, expected {version!r}")
        logprobs = [step[t].logprob for step, t in zip(out.logprobs, ids, strict=True)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(ids, logprobs, text, _finish_reason(out), token_versions=versions)

    def _set_version(self, version: str) -> None:
        self.llm.llm_engine.set_weight_version(version)
        self.version = version

    def _warm_up(self, model_path: str) -> None:
        """Hook the samplers (engine/vllm_logprobs.py) and decode two tokens: vLLM refuses some
        models only when it first runs them, and the recorded log-probs must be the full
        softmax's."""
        from cadence.models import ModelLoadError

        try:
            self.runners = self.llm.collective_rpc(hook_sampler)
            check_full_softmax(self.generate([Request([0], [0])], CHECK_PARAMS)[0])
        except Exception as e:
            self._jobs.clear()
            self.close()
            raise ModelLoadError(
                f"vLLM cannot run the model in '{model_path}': {type(e).__name__}: {e}"
            ) from e
        self.occupancy.clear()


def _vllm_params(params: SamplingParams, seed: int, max_tokens: int):
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        seed=seed,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # stop where cadence's engines stop: at `stop_token_ids` (EOS among them)
        include_stop_str_in_output=True,
        logprobs=0,  # the sampled token's own log-prob
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _token_versions(spans: list[tuple[str, int, int]], num_tokens: int) -> list[int]:
    """Each token's version from vLLM's spans of weight labels, which must cover the tokens and
    be versions (numbers: what a worker labels weights with)."""
    versions: list[int] = []
    for label, start, end in spans:
        if start != len(versions) or not label.lstrip("-").isdigit():
            raise RuntimeError(f"a sample's weight versions {spans} are not numbered spans")
        versions += [int(label)] * (end - start)
    if len(versions) != num_tokens:
        raise RuntimeError(f"weight versions {spans} cover {len(versions)} of {num_tokens} tokens")
    return versions


def _finish_reason(out) -> str:
    """vLLM's 'stop' covers EOS, stop ids (`stop_reason` an int or None) and stop strings."""
    if out.finish_reason == "length":
        return "length"
    if out.finish_reason == "stop":
        return "stop" if isinstance(out.stop_reason, str) else "eos"
    raise RuntimeError(f"vLLM ended a sample with finish reason {out.finish_reason!r}")
