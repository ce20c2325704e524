"""vLLM on other models (each engine started and closed in turn: one per process at a time):
an untied Qwen2 with biases, a model vLLM cannot run, engine arguments vLLM does not have."""

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
