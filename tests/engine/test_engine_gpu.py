"""GPU checks: run where a CUDA device is present (the suite's CPU run skips them)."""

import pytest
import torch

from cadence.engine import HFEngine, Request, SamplingParams, derive_seed
from cadence.models import load_model, load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_samples_and_logprobs_match_the_full_forward(model_dir, tokenizer):
    model = load_model(model_dir, device="cuda")
    prompt = tokenizer("Question: What is 3 + 4?\nAnswer: ")["input_ids"]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    (group,) = HFEngine(model, tokenizer).generate(
        [Request(prompt, [derive_seed(0, 0, 0, j) for j in range(4)])], params
    )
    for c in group:
        ids = torch.tensor([prompt + c.token_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_vllm_on_cuda_records_the_full_softmax_with_top_p(tmp_path):
    # vLLM's default model runner on GPUs is V2, whose sampler is hooked apart from the CPU's V1
    # (engine/vllm_logprobs.py): with top_p < 1 the record must be as close to the learner's
    # log softmax(logits / T) as with top_p = 1; renormalised over the nucleus it would be
    # log(nucleus mass) above it, tenths here
    from cadence.engine.vllm import VLLMEngine
    from engine_checks import max_logprob_diff
    from tiny_models import save_vllm_ready

    path = save_vllm_ready(tmp_path / "llama", "llama")
    tok = load_tokenizer(path)
    prompts = ["Question: What is 3 + 4?\nAnswer: ", "Question: What is 19 - 8?\nAnswer: "]
    requests = [
        Request(
            tok(p, add_special_tokens=False)["input_ids"],
            [derive_seed(7, 0, i, j) for j in range(4)],
        )
        for i, p in enumerate(prompts)
    ]
    engine = VLLMEngine(path, tok, max_num_seqs=16)
    try:
        diffs = {}
        for top_p in (1.0, 0.6):
            params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=top_p)
            outputs = engine.generate(requests, params)
            diffs[top_p] = max_logprob_diff(load_model(path), requests, outputs, 0.8)
    finally:
        engine.close()
    assert diffs[1.0] <= 1e-3, diffs
    assert diffs[0.6] <= max(1e-4, 2 * diffs[1.0]), diffs
