"""GPU checks: run where a CUDA device is present (the suite's CPU run skips them)."""

import pytest
import torch

from cadence.engine import HFEngine, Request, SamplingParams, derive_seed
from cadence.models import load_model

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
