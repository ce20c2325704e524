"""`make gpu-check`: cadence's learner and engine on one CUDA GPU, offline, in about six minutes.

It installs nothing and downloads nothing: the models are built from configs (random weights of
Qwen2.5-1.5B's shape), the tokenizer is trained on the spot, and it needs only torch (CUDA),
transformers and tokenizers, which the lent GPU machine has (docs/benchmarks.md says what else
can be carried). Each step writes one JSON line to OUT/gpu_check.jsonl as soon as it ends, its
figures or why it was skipped (a missing dependency, no CUDA, the time budget), so a check cut
short keeps what it measured:

0. environment: GPU, driver, torch, CUDA, transformers and the optional packages present;
1. learner peak memory at 512 and 1,024 response tokens: full logits, chunked log-probs, chunked
   log-probs with activation checkpointing (peak CUDA memory of one micro-batch, and seconds);
2. one bf16-mixed step against a float32 step at lr 1e-6: the fraction of weights each moves;
3. engine against learner log-probs in bf16: cadence's continuous engine samples, the learner
   recomputes (mean and max |diff| on the sampled tokens);
4. decode tokens/s of cadence's continuous engine;
5. FSDP2 on one GPU over NCCL (a rank process) against the one-process learner;
6. placement, with two GPUs or more: two worker processes placed as a run places them each see
   one GPU of their own;
7. broadcast, with two GPUs or more: a version in 64 MiB buckets over NCCL into a second copy,
   seconds per GB and the receiver's extra memory;
8. vLLM reload, where vLLM is importable (not on the lent machine as it is): new weights loaded
   in place into an in-process vLLM engine (seconds, GB/s), and the log-probs of what it then
   samples against the learner's model; with sleep mode (on a GPU), one sleep -> train -> wake
   cycle as a colocated run makes it: the memory each phase holds, and the seconds;
9. DDP with a bf16 model and float32 masters (one rank on one GPU): where the masters live, and
   the update against the one-process mixed learner;
10. FSDP2 with activation checkpointing and mixed precision: the units counted (the root and one
   per decoder layer), the rank's peak memory, the update against the one-process learner;
11. local ranks publishing to a worker: after an iteration the driver's copy (in host memory)
   is the rank's gathered weights byte for byte, a worker's engine loads the published version,
   and its behaviour log-probs equal the learner's recomputation.

On a machine without CUDA it runs step 0 and writes the reason for every other step; exit 0
unless a step failed (1). `--device cpu --shape tiny` runs every step on a tiny model on the CPU
(CI does, so the check cannot rot).

    python3 benchmarks/gpu_check.py --out runs/gpu-check [--steps 0,1,2] [--budget-s 360]
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the repository's cadence, without installing it

SHAPES = {  # transformers Qwen2Config fields: Qwen2.5-1.5B's shape, and a tiny one for CI
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}
OPTIONAL = ("vllm", "ray", "pydantic", "fastapi", "peft", "safetensors", "numpy", "rich")


class Skip(Exception):
    """A step that cannot run here: the message says why."""


@dataclass
class Check:
    device: str
    shape: str
    out: Path
    deadline: float
    records: list[dict] = field(default_factory=list)

    def config(self, layers: int | None = None):
        from transformers import Qwen2Config

        kw = dict(SHAPES[self.shape], attn_implementation="sdpa")
        if layers is not None:
            kw["num_hidden_layers"] = layers
        return Qwen2Config(**kw)

    def model(self, dtype, layers: int | None = None):
        """A random-weight model of the shape, built on the device, in `dtype`, train mode."""
        import torch
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(0)
        with torch.device(self.device):
            model = Qwen2ForCausalLM(self.config(layers)).to(dtype)
        return model.train()

    def write(self, record: dict) -> None:
        self.records.append(record)
        with (self.out / "gpu_check.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def needs_cuda(check: Check) -> None:
    import torch

    if check.device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise Skip(f"no CUDA device: torch {torch.__version__} ({build}) sees no GPU")


def step_environment(check: Check) -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    for name in ("torch", "transformers", "tokenizers", *OPTIONAL):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out["torch"] is None:
        raise Skip("torch is not importable: no step can run")
    import torch

    out |= {"cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": p.name,
            "gpu_memory_gb": p.total_memory / 1e9,
            "gpus": torch.cuda.device_count(),
        }
        out["driver"] = _driver()
    return out


def _driver() -> str | None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_smi import gpu_names

    names = gpu_names()
    return names[0].rsplit(",", 1)[-1].strip() if names else None


def _groups(check: Check, responses: int, group_size: int = 8, prompt: int = 256):
    from cadence.bench.shared_prompt import synthetic_groups

    vocab = SHAPES[check.shape]["vocab_size"]
    return synthetic_groups(vocab, 1, prompt, responses, group_size)


def _peak(fn: Callable[[], None]) -> tuple[float, float]:
    """(peak bytes `fn` adds on the CUDA device, seconds); on the CPU, (0, seconds)."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, time.perf_counter() - start
    return 0.0, time.perf_counter() - start


def step_learner_memory(check: Check) -> dict:
    needs_cuda(check)
    import torch

    from cadence.algo import AlgoParams
    from cadence.learner import Learner, LearnerParams, StepSums, score
    from cadence.learner.precision import Masters

    base = check.model(torch.float32)
    out: dict = {}
    for tokens in (512, 1024) if check.shape != "tiny" else (16,):  # CI: each variant once
        groups = score(_groups(check, tokens), AlgoParams())
        for name, chunk, ckpt in (
            ("full", 0, False),
            ("chunked", 1024, False),
            ("ckpt", 1024, True),
        ):
            model = copy.deepcopy(base)
            masters = Masters.split(model, torch.bfloat16)
            params = LearnerParams(logits_chunk_tokens=chunk, activation_checkpointing=ckpt)
            learner = Learner(model, params, AlgoParams(kl_coef=0.0), 0, masters=masters)
            learner.begin_iteration()

            def one_pass(learner=learner, groups=groups) -> None:
                learner.forward_backward(groups, StepSums())

            peak, seconds = _peak(one_pass)
            out[f"{name}_{tokens}_peak_gb"] = peak / 1e9
            out[f"{name}_{tokens}_s"] = seconds
            del learner, model, masters
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def step_mixed_step(check: Check) -> dict:
    needs_cuda(check)
    import torch

    from cadence.algo import AlgoParams
    from cadence.learner import Learner, LearnerParams, score
    from cadence.learner.precision import Masters

    groups = _groups(check, 64 if check.shape != "tiny" else 8)
    out = {}
    for kind in ("float32", "mixed", "bfloat16"):
        dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
        model = check.model(dtype, layers=4)
        masters = Masters.split(model, torch.bfloat16) if kind == "mixed" else None
        algo = AlgoParams(kl_coef=0.0)
        learner = Learner(model, LearnerParams(lr=1e-6), algo, 0, masters=masters)
        before = [p.detach().clone() for p in learner.trained]
        learner.train_iteration(iter(score(groups, algo)), len(groups))
        moved = sum(int((p != b).sum()) for p, b in zip(learner.trained, before, strict=True))
        out[f"{kind}_moved_frac"] = moved / sum(b.numel() for b in before)
        del learner, model, masters, before
    return out


def _tokenizer():
    from cadence.models.presets import train_tokenizer

    return train_tokenizer([f"{a} + {b} = {a + b}" for a in range(50) for b in range(50)], 512)


def step_logprobs(check: Check) -> dict:
    needs_cuda(check)
    import torch

    from cadence.algo import AlgoParams
    from cadence.engine import ContinuousEngine, Request, SamplingParams
    from cadence.learner import Learner, LearnerParams, score
    from cadence.learner.batch import responses
    from cadence.learner.logprobs import token_logprobs
    from cadence.learner.packing import LAYOUTS
    from cadence.learner.precision import Masters
    from cadence.types import Group, Prompt

    model = check.model(torch.float32, layers=8 if check.shape != "tiny" else None)
    masters = Masters.split(model, torch.bfloat16)  # bf16 compute, as a bf16 run decodes
    learner = Learner(model, LearnerParams(), AlgoParams(kl_coef=0.0), 0, masters=masters)
    engine = ContinuousEngine(model.eval(), _tokenizer(), max_num_seqs=64)
    vocab = SHAPES[check.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    with torch.no_grad():
        out = engine.generate(
            [Request(p, list(range(4 * i, 4 * i + 4))) for i, p in enumerate(prompts)], params
        )
    groups = [
        Group(Prompt(f"p{i}", "", ""), p, cs, 0, 0)
        for i, (p, cs) in enumerate(zip(prompts, out, strict=True))
    ]
    scored = score(groups, AlgoParams())
    device = next(model.parameters()).device
    tokens = [(g.prompt_ids, [c.token_ids for c in g.completions]) for g in groups]
    layout = LAYOUTS[learner.layout](tokens, 0).to(device)
    resp = responses(scored, 0, 0, device)
    model.eval()
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, layout, resp.tokens, 1.0, False)
    diff = (logprobs.float() - resp.behaviour_logprobs).abs()[resp.loss_mask > 0]
    return {
        "tokens": int(diff.numel()),
        "abs_diff_mean": diff.mean().item(),
        "abs_diff_max": diff.max().item(),
    }


def step_decode(check: Check) -> dict:
    needs_cuda(check)
    import torch

    from cadence.engine import ContinuousEngine, Request, SamplingParams

    model = check.model(torch.bfloat16).eval()
    engine = ContinuousEngine(model, _tokenizer(), max_num_seqs=64)
    vocab = SHAPES[check.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    requests = [
        Request(torch.randint(0, vocab, (128,), generator=gen).tolist(), [i]) for i in range(64)
    ]
    new = 256 if check.shape != "tiny" else 16
    params = SamplingParams(max_new_tokens=new, temperature=1.0)  # no stop: every sequence runs
    with torch.no_grad():
        engine.generate(requests[:8], SamplingParams(max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        out = engine.generate(requests, params)
        seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for cs in out for c in cs)
    return {
        "sequences": len(requests),
        "new_tokens": generated,
        "tokens_per_s": generated / seconds,
    }


def step_fsdp(check: Check) -> dict:
    needs_cuda(check)
    import tempfile

    import torch

    from cadence.algo import AlgoParams
    from cadence.backend.placement import place, visible_gpus
    from cadence.learner import Learner, LearnerParams, score
    from cadence.learner.driver import start_local_ranks
    from cadence.learner.rank import RankSpec
    from cadence.metrics import Tracer
    from cadence.models import save_pretrained

    layers = 4 if check.shape != "tiny" else None
    model = check.model(torch.float32, layers=layers)
    algo = AlgoParams(kl_coef=0.0)
    params = LearnerParams(lr=1e-4, micro_batch_groups=1)
    groups = score(_groups(check, 64 if check.shape != "tiny" else 8), algo)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(copy.deepcopy(model).cpu(), _tokenizer(), Path(d))
        one = Learner(copy.deepcopy(model).to(check.device), params, algo, 0)
        one.train_iteration(iter(groups), len(groups))
        spec = RankSpec(d, params, algo, 0, 1, "fsdp")
        # the rank process sees the first GPU only (CUDA_VISIBLE_DEVICES), as a run places it
        gpus = place(1, 1.0, 0, 0.0, visible_gpus()) if check.device.startswith("cuda") else None
        ranked = start_local_ranks(spec, copy.deepcopy(model).cpu(), Tracer(), gpus)
        try:
            ranked.train_iteration(iter(groups), len(groups))
        finally:
            ranked.close()
    want = {k: v.detach().cpu() for k, v in one.model.named_parameters()}
    got = {k: v.detach().cpu() for k, v in ranked.model.named_parameters()}
    diff = max((got[k] - w).abs().max().item() for k, w in want.items())
    moved = max(
        (w - p.detach().cpu()).abs().max().item()
        for (k, w), p in zip(want.items(), model.parameters(), strict=True)
    )
    return {
        "max_abs_diff": diff,
        "moved": moved,
        "backend": "nccl" if check.device.startswith("cuda") else "gloo",
    }


def _gpus_or_cpu(check: Check, least: int) -> list[str]:
    """The devices of a two-sided step: `least` visible GPUs, or the CPU (`--device cpu`)."""
    import torch

    if not check.device.startswith("cuda"):
        return ["cpu"] * least
    needs_cuda(check)
    if torch.cuda.device_count() < least:
        raise Skip(f"needs {least} GPUs; {torch.cuda.device_count()} visible")
    return [f"cuda:{i}" for i in range(least)]


def step_placement(check: Check) -> dict:
    """Two worker processes placed as a run places them (pipeline.num_gpus_per_worker = 1): each
    starts with its own CUDA_VISIBLE_DEVICES and sees one GPU, a different one."""
    import subprocess

    from cadence.backend.placement import place, visible_gpus

    if _gpus_or_cpu(check, 2) == ["cpu", "cpu"]:
        raise Skip("placement needs 2 GPUs (the CPU has no devices to place)")
    placement = place(0, 0.0, 2, 1.0, visible_gpus())
    probe = (
        "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"
    )
    seen = []
    for wid in range(2):
        env = placement.worker_env(wid)
        out = subprocess.run(
            [sys.executable, "-c", probe], env=os.environ | env, capture_output=True, text=True
        )
        count, uuid = out.stdout.split()
        seen.append(
            {"cuda_visible_devices": env["CUDA_VISIBLE_DEVICES"], "count": int(count), "uuid": uuid}
        )
    if len({w["uuid"] for w in seen}) != 2 or any(w["count"] != 1 for w in seen):
        raise RuntimeError(f"the two workers do not each see one GPU of their own: {seen}")
    return {"workers": seen}


def step_broadcast(check: Check) -> dict:
    """A version of the model broadcast in 64 MiB buckets over its own process group (NCCL
    between two GPUs; gloo on the CPU) into a second copy: seconds per GB, and the receiver's
    extra memory (one bucket)."""
    import tempfile
    import threading

    import torch

    from cadence.backend.ray.weights import BroadcastReceiver, BroadcastWeights, num_bytes
    from cadence.engine import EngineWeights, ScriptedEngine

    send_dev, recv_dev = _gpus_or_cpu(check, 2)
    learner = check.model(torch.bfloat16).to(send_dev)
    worker = check.model(torch.bfloat16).to(recv_dev)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1.0)
    sender = BroadcastWeights(learner)
    engine = EngineWeights(ScriptedEngine(lambda ids, seed: [1]), worker)
    receiver = BroadcastReceiver(engine, recv_dev)
    times = []
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{d}/store"
        joined = threading.Thread(target=receiver.join, args=(sender.backend, init, 1, 2, {}, 120))
        joined.start()
        sender.join(init, 2, {}, 120)
        joined.join()
        try:
            for version in range(1, 4):  # the first warms the group's connections up
                start = time.perf_counter()
                loading = threading.Thread(target=receiver.load, args=(version,))
                loading.start()
                sender.publish(learner, version)
                loading.join()
                if recv_dev.startswith("cuda"):
                    torch.cuda.synchronize(recv_dev)
                times.append(time.perf_counter() - start)
        finally:
            sender.close()
            receiver.close()
    same = all(
        torch.equal(a.cpu(), b.cpu())
        for a, b in zip(learner.parameters(), worker.parameters(), strict=True)
    )
    if not same:
        raise RuntimeError("the broadcast did not deliver the learner's weights")
    gb = num_bytes(learner) / 1e9
    return {
        "backend": sender.backend,
        "version_gb": gb,
        "version_seconds": times,
        "seconds_per_gb": min(times[1:]) / gb,
        "receiver_extra_mb": receiver.buffer_bytes / 2**20,
        "buckets": len(sender.buckets),
    }


def step_vllm_reload(check: Check) -> dict:
    """vLLM in this process (when it is importable): a version of new weights loaded in place,
    seconds and GB/s, then the log-probs of what it samples against the learner's model."""
    needs_cuda(check)
    import tempfile

    import torch

    from cadence.engine import Request, SamplingParams
    from cadence.engine.vllm import VLLMEngine, VLLMOptions, vllm_available
    from cadence.models import save_pretrained

    if not vllm_available():
        raise ImportError("No module named 'vllm'")
    from transformers import Qwen2ForCausalLM

    dtype = torch.bfloat16 if check.device.startswith("cuda") else torch.float32
    config = check.config(layers=8 if check.shape != "tiny" else None)
    if check.shape == "tiny":  # vLLM's CPU attention has no kernel for heads of 16
        config.num_attention_heads, config.num_key_value_heads = 2, 1
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    tok = _tokenizer()
    options = VLLMOptions(enforce_eager=True, gpu_memory_utilization=0.3, sleep_mode=True)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, tok, d)
        engine = VLLMEngine(d, tok, max_num_seqs=16, dtype=str(dtype)[6:], options=options)
    try:
        model.to(check.device)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        times = []
        for version in range(1, 4):  # the first warms vLLM's reload path up
            start = time.perf_counter()
            engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), version)
            if check.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(4)]
        requests = [Request(p, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
        out = engine.generate(requests, SamplingParams(max_new_tokens=16, temperature=1.0))
        slept = _sleep_cycle(engine, model) if engine.can_sleep else {"sleep": "unavailable here"}
    finally:
        engine.close()
    diffs = []
    model.eval()
    with torch.no_grad():
        for request, samples in zip(requests, out, strict=True):
            for c in samples:
                ids = torch.tensor([request.prompt_ids + c.token_ids], device=check.device)
                logits = model(ids).logits[0, len(request.prompt_ids) - 1 : -1].float()
                mine = torch.log_softmax(logits, -1)[range(len(c.token_ids)), c.token_ids]
                diffs += (mine.cpu() - torch.tensor(c.logprobs)).abs().tolist()
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    return {
        "dtype": str(dtype),
        "version_gb": gb,
        "reload_seconds": times,
        "reload_gb_per_s": gb / min(times[1:]),
        "tokens": len(diffs),
        "abs_diff_mean": sum(diffs) / len(diffs),
        "abs_diff_max": max(diffs),
    } | slept


def _sleep_cycle(engine, model) -> dict:
    """One sleep -> train -> wake cycle as a colocated run makes it: vLLM sleeps (level 2: the next
    sync brings every weight), the learner allocates what a step holds (a stand-in as large as
    the freed memory, then freed, as PyTorch's caching allocator keeps it), the next version
    wakes it (PyTorch's cached blocks returned first). GiB free in each phase, and seconds."""
    import torch

    gib = 2**30
    free = {"awake": torch.cuda.mem_get_info()[0] / gib}
    start = time.perf_counter()
    engine.sleep()
    asleep = time.perf_counter()
    free["asleep"] = torch.cuda.mem_get_info()[0] / gib
    stand_in = torch.empty(int((free["asleep"] - free["awake"]) * 0.8 * gib), dtype=torch.uint8,
                           device="cuda")  # fmt: skip
    free["training"] = torch.cuda.mem_get_info()[0] / gib
    del stand_in  # freed, but cached by PyTorch until the wake returns it
    woke = time.perf_counter()
    engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), 99)
    free["woken and loaded"] = torch.cuda.mem_get_info()[0] / gib
    return {
        "free_gib": free,
        "sleep_level": 1 if engine.takes_adapters else 2,
        "sleep_s": asleep - start,
        "wake_and_load_s": time.perf_counter() - woke,
    }


def _ranked(check: Check, model, params, algo, strategy: str, dtype: str = "float32"):
    """`learner.ranks = 1` on the check's device (the rank process sees the first GPU only),
    over `model`'s weights saved to a temporary directory; the ranked learner and the directory."""
    import tempfile

    from cadence.backend.placement import place, visible_gpus
    from cadence.learner.driver import start_local_ranks
    from cadence.learner.rank import RankSpec
    from cadence.metrics import Tracer
    from cadence.models import save_pretrained

    d = tempfile.mkdtemp(prefix="cadence-gpu-check-")
    save_pretrained(copy.deepcopy(model).cpu(), _tokenizer(), Path(d))
    spec = RankSpec(d, params, algo, 0, 1, strategy, dtype=dtype)
    gpus = place(1, 1.0, 0, 0.0, visible_gpus()) if check.device.startswith("cuda") else None
    return start_local_ranks(spec, copy.deepcopy(model).cpu(), Tracer(), gpus), d


def _max_diff(a, b) -> float:
    """Largest difference between two lists of tensors (parameters, masters), in float32."""
    return max((x.detach().float().cpu() - y.detach().float().cpu()).abs().max().item()
               for x, y in zip(a, b, strict=True))  # fmt: skip


def step_ddp_bf16(check: Check) -> dict:
    """DDP under mixed precision (model.dtype = 'bfloat16', float32 masters) on one rank: the
    masters on the rank's device (made on the CPU and the first gradient failed), its update
    against the one-process mixed learner's."""
    needs_cuda(check)
    import shutil

    import torch

    from cadence.algo import AlgoParams
    from cadence.learner import Learner, LearnerParams, score
    from cadence.learner.precision import Masters

    model = check.model(torch.float32, layers=4 if check.shape != "tiny" else None)
    algo, params = AlgoParams(kl_coef=0.0), LearnerParams(lr=1e-4, micro_batch_groups=1)
    groups = score(_groups(check, 64 if check.shape != "tiny" else 8), algo)
    one_model = copy.deepcopy(model).to(check.device)
    masters = Masters.split(one_model, torch.bfloat16)
    one = Learner(one_model, params, algo, 0, masters=masters)
    one.train_iteration(iter(groups), len(groups))
    ranked, d = _ranked(check, model, params, algo, "ddp", dtype="bfloat16")
    try:
        ranked.train_iteration(iter(groups), len(groups))
        where = ranked.described[0]
    finally:
        ranked.close()
        shutil.rmtree(d, ignore_errors=True)
    expected = "cuda:0" if check.device.startswith("cuda") else "cpu"
    if where.get("master_device") != expected:
        raise RuntimeError(f"the rank's float32 masters are on {where.get('master_device')}")
    return {
        "master_device": where["master_device"],
        # the driver's copy is the rank's bf16 model, as the one-process learner's model is
        "max_abs_diff": _max_diff(ranked.model.parameters(), one.model.parameters()),
    }


def step_fsdp_checkpointed(check: Check) -> dict:
    """FSDP2 with activation checkpointing and bf16 compute over float32 shards: every decoder
    layer a unit of its own besides the root (the checkpointed layers were missed and the rank
    held them whole), the rank's peak memory, its update against the one-process learner's."""
    needs_cuda(check)
    import shutil

    import torch

    from cadence.algo import AlgoParams
    from cadence.learner import Learner, LearnerParams, score
    from cadence.learner.precision import Masters

    layers = 4 if check.shape != "tiny" else 2
    model = check.model(torch.float32, layers=layers)
    algo = AlgoParams(kl_coef=0.0)
    params = LearnerParams(lr=1e-4, micro_batch_groups=1, activation_checkpointing=True)
    groups = score(_groups(check, 64 if check.shape != "tiny" else 8), algo)
    one_model = copy.deepcopy(model).to(check.device)
    one = Learner(one_model, params, algo, 0, masters=Masters.split(one_model, torch.bfloat16))
    one.train_iteration(iter(groups), len(groups))
    ranked, d = _ranked(check, model, params, algo, "fsdp", dtype="bfloat16")
    try:
        stats = ranked.train_iteration(iter(groups), len(groups))
        units = ranked.described[0]["fsdp_units"]
    finally:
        ranked.close()
        shutil.rmtree(d, ignore_errors=True)
    if units != 1 + layers:
        raise RuntimeError(f"{units} FSDP units for {layers} decoder layers and the root")
    memory = {k: v for k, v in stats.items() if "peak" in k}
    # FSDP's shards are the float32 masters, gathered as they are into the driver's copy
    diff = _max_diff(ranked.model.parameters(), one.masters.params)
    return {"fsdp_units": units, "max_abs_diff": diff} | memory


def step_rank_publish(check: Check) -> dict:
    """Local ranks publish to a worker as a run does: after an iteration the driver's copy (in
    host memory) is what the rank gathered, byte for byte into the shared tensors a worker loads;
    the worker's engine samples, the learner recomputes its log-probs."""
    needs_cuda(check)
    import shutil

    import torch

    from cadence.algo import AlgoParams
    from cadence.backend.weights import SharedWeights
    from cadence.engine import ContinuousEngine, EngineWeights, Request, SamplingParams
    from cadence.learner import LearnerParams, score
    from cadence.learner.logprobs import from_logits

    model = check.model(torch.float32, layers=4 if check.shape != "tiny" else None)
    algo, params = AlgoParams(kl_coef=0.0), LearnerParams(lr=1e-4, micro_batch_groups=1)
    groups = score(_groups(check, 64 if check.shape != "tiny" else 8), algo)
    ranked, d = _ranked(check, model, params, algo, "fsdp")
    try:
        ranked.train_iteration(iter(groups), len(groups))
    finally:
        ranked.close()
        shutil.rmtree(d, ignore_errors=True)
    driver = ranked.model
    shared = SharedWeights(driver)
    shared.publish(driver, 1)
    same = all(torch.equal(shared.tensors[n], p.detach()) for n, p in driver.named_parameters())
    worker_model = check.model(torch.float32, layers=4 if check.shape != "tiny" else None).eval()
    weights = EngineWeights(ContinuousEngine(worker_model, _tokenizer()), worker_model)
    weights.load(shared.tensors, 1)
    vocab = SHAPES[check.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(4)]
    out = weights.engine.generate([Request(p, [i]) for i, p in enumerate(prompts)],
                                  SamplingParams(max_new_tokens=16))  # fmt: skip
    learner = copy.deepcopy(driver).to(check.device).eval()
    diffs = []
    with torch.no_grad():
        for p, (c,) in zip(prompts, out, strict=True):
            ids = torch.tensor([p + c.token_ids], device=check.device)
            logits = learner(ids).logits[:, len(p) - 1 : -1]
            mine, _ = from_logits(
                logits, torch.tensor([c.token_ids], device=check.device), 1.0, False
            )
            diffs += (mine[0].cpu() - torch.tensor(c.logprobs)).abs().tolist()
    if not same:
        raise RuntimeError("the published version is not the driver's copy byte for byte")
    return {"driver_device": str(next(driver.parameters()).device), "published_equal": same,
            "logprob_abs_diff_max": max(diffs), "tokens": len(diffs)}  # fmt: skip


STEPS: list[tuple[str, Callable[[Check], dict]]] = [
    ("environment", step_environment),
    ("learner_memory", step_learner_memory),
    ("mixed_step", step_mixed_step),
    ("logprobs", step_logprobs),
    ("decode", step_decode),
    ("fsdp", step_fsdp),
    ("placement", step_placement),
    ("broadcast", step_broadcast),
    ("vllm_reload", step_vllm_reload),
    ("ddp_bf16", step_ddp_bf16),
    ("fsdp_checkpointed", step_fsdp_checkpointed),
    ("rank_publish", step_rank_publish),
]


def run(check: Check, steps: list[int]) -> int:
    failed = 0
    for n, (name, fn) in enumerate(STEPS):
        if n not in steps:
            continue
        record: dict = {"step": n, "name": name}
        start = time.perf_counter()
        try:
            if time.monotonic() > check.deadline:
                raise Skip("the check's time budget is spent")
            record |= fn(check)
        except Skip as e:
            record["skipped"] = str(e)
        except ImportError as e:
            record["skipped"] = f"a dependency is missing: {e}"
        except Exception:
            record["error"] = traceback.format_exc(limit=8)
            failed += 1
        record["seconds"] = time.perf_counter() - start
        check.write(record)
        print(json.dumps(record), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--steps", default=",".join(str(n) for n in range(len(STEPS))))
    ap.add_argument("--budget-s", type=float, default=360.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.jsonl").unlink(missing_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check = Check(args.device, args.shape, out, time.monotonic() + args.budget_s)
    return run(check, [int(s) for s in args.steps.split(",")])


if __name__ == "__main__":
    sys.exit(main())
