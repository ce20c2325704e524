"""vLLM on other models (each engine started and closed in turn: one per process at a time):
an untied Qwen2 with biases, a model vLLM cannot run, engine arguments vLLM does not have."""

from pathlib import Path

import pytest

from cadence.config import ConfigError
from cadence.engine import Request, SamplingParams, derive_seed, make_engine
from cadence.engine.vllm import VLLMEngine, VLLMOptions
from cadence.models import ModelLoadError, init_model, load_model, load_tokenizer
from engine_checks import max_logprob_diff
from tiny_models import save_vllm_ready

pytestmark = pytest.mark.slow

CPU = VLLMOptions(enforce_eager=True)


def test_qwen2_logprobs_equal_the_learner_recomputation(tmp_path):
    # untied output layer, q/k/v biases; fp32 on both sides (observed max |diff| 4.8e-7)
    path = save_vllm_ready(tmp_path / "qwen2", "qwen2")
    tok = load_tokenizer(path)
    requests = [
        Request(
            tok(f"Question: {q}\nAnswer: ")["input_ids"],
            [derive_seed(3, 0, i, j) for j in range(3)],
        )
        for i, q in enumerate(["What is 3 + 4?", "What is 19 - 8?"])
    ]
    # a step of at most 256 tokens: the 8 long prompts below take more than one (with chunked
    # prefill, as vLLM has it by default, a split prefill crashed the CPU engine: "CPU
    # Generator does not use offset")
    small_steps = VLLMOptions(enforce_eager=True, engine_args={"max_num_batched_tokens": 256})
    engine = VLLMEngine(path, tok, max_num_seqs=8, options=small_steps)
    try:
        outputs = engine.generate(requests, SamplingParams(max_new_tokens=12, temperature=0.8))
        long = [Request([5 + i] * 200, [i, i + 8]) for i in range(4)]
        split = engine.generate(long, SamplingParams(max_new_tokens=4, temperature=1.0))
        with pytest.raises(RuntimeError, match="already open"):
            VLLMEngine(path, tok, options=CPU)
    finally:
        engine.close()
    assert max_logprob_diff(load_model(path), requests, outputs, 0.8) <= 1e-5
    assert [len(c.token_ids) for group in split for c in group] == [4] * 8
    with pytest.raises(ConfigError, match="leave it out"):
        VLLMOptions(engine_args={"enable_chunked_prefill": True}).engine_kwargs(
            path, "auto", 8, True
        )


def test_a_model_vllm_cannot_run_is_refused_with_its_reason(tmp_path):
    # the 'test' preset has attention heads of size 16; vLLM's CPU attention has no kernel
    init_model("test", tmp_path / "head16", ["1 + 2 = 3"] * 50, seed=0)
    path = str(tmp_path / "head16")
    tok = load_tokenizer(path)
    with pytest.raises(ModelLoadError, match=r"head16.*head_dim=16"):
        VLLMEngine(path, tok, options=CPU)
    unknown = VLLMOptions(engine_args={"no_such_arg": 1})
    with pytest.raises(ConfigError, match=r"engine_args\.no_such_arg"):
        VLLMEngine(path, tok, options=unknown)
    with pytest.raises(ValueError, match="model_path"):
        make_engine("vllm", None, tok, 8)
    # the engine it refused is closed: another one starts
    ok = save_vllm_ready(tmp_path / "ok", "llama")
    VLLMEngine(ok, load_tokenizer(ok), options=CPU).close()


def test_a_lora_adapter_alone_gives_the_policys_logprobs_version_after_version(tmp_path):
    # before, a LoRA policy reached vLLM as merged whole weights at every sync
    import torch

    from cadence.backend import LearnerAdapter
    from cadence.models.lora import LoraSpec, apply_lora

    path = save_vllm_ready(tmp_path / "llama", "llama")
    tok = load_tokenizer(path)
    spec = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj"))
    policy = apply_lora(load_model(path), spec, path)
    requests = [
        Request(tok("What is 3 + 4?")["input_ids"], [derive_seed(5, 0, 0, j) for j in (0, 1)])
    ]
    engine = VLLMEngine(
        path, tok, max_num_seqs=8, options=VLLMOptions(enforce_eager=True, lora_rank=4)
    )
    sync = LearnerAdapter(engine, policy)
    adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    assert (
        sync.num_bytes
        == adapter_bytes
        < sum(p.numel() * 4 for p in load_model(path).parameters()) / 20
    )
    diffs = []
    try:
        for version in (1, 2):
            torch.manual_seed(version)
            with torch.no_grad():  # an adapter that moves the policy (peft starts B at zero)
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.3)
            sync(version)
            assert not any(sync.target._dir.iterdir())  # vLLM read it before the sync returned
            outputs = engine.generate(requests, SamplingParams(max_new_tokens=8, temperature=1.0))
            assert all(c.token_ids for c in outputs[0]) and engine.version == str(version)
            diffs.append(max_logprob_diff(policy, requests, outputs, 1.0))
            with policy.disable_adapter():
                assert max_logprob_diff(policy, requests, outputs, 1.0) > 1e-2  # not the base
        assert len(engine.llm.llm_engine.list_loras()) == 1  # version 1's adapter dropped
    finally:
        engine.close()
    assert max(diffs) <= 1e-5, diffs


def test_tensor_parallel_workers_read_one_copy_of_a_version_and_sample_from_it(tmp_path):
    # before, the weights went to collective_rpc as a list: pickled, and a whole copy unpickled
    # in each tensor-parallel worker process (on a GPU, every CUDA tensor through host memory)
    import torch

    path = save_vllm_ready(tmp_path / "llama", "llama")
    tok = load_tokenizer(path)
    model = load_model(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    requests = [Request(tok("What is 3 + 4?")["input_ids"], [1, 2])]
    tp2 = VLLMOptions(enforce_eager=True, tensor_parallel_size=2)
    engine = VLLMEngine(path, tok, max_num_seqs=8, options=tp2)
    sent, rpc = [], engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda method, **kw: sent.append((method, kw)) or rpc(method, **kw)
    try:
        engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), 1)
        outputs = engine.generate(requests, SamplingParams(max_new_tokens=8, temperature=1.0))
    finally:
        engine.close()
    (kw,) = [kw for m, kw in sent if m == "reload_weights"]
    assert set(kw["kwargs"]) == {"weights_path", "is_checkpoint_format"}  # no tensors pickled
    assert not Path(kw["kwargs"]["weights_path"]).exists()  # the version's files are gone
    size = sum(p.numel() * 4 for p in model.parameters())
    assert engine.version_bytes == size  # one copy of the version for both workers
    assert max_logprob_diff(model, requests, outputs, 1.0) <= 1e-5
