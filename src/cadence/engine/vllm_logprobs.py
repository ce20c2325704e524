"""vLLM's record of a sampled token's log-prob, made the learner's: log softmax(logits / T).

vLLM 0.32 records one of four `logprobs_mode`s: `raw_logprobs` (log softmax of the logits before
temperature), `raw_logits`, `processed_logits`, and `processed_logprobs` (after temperature and
top-k/top-p: with top_p < 1 renormalised over the nucleus, log(nucleus mass) above the learner's
value). None is log softmax(logits / T) whatever top_p, the quantity cadence's own engines record
(`engine.base.sample_tokens`) and the learner recomputes, so off-policy ratios and TIS weights
would shift with the nucleus. `hook_sampler` runs on each of vLLM's workers and has its sampler
take the log-probs after temperature and before top-k/top-p, which then only decide where the
sample may fall; `check_full_softmax` proves at start-up that the record is the full softmax's.

It changes what vLLM records, never what it samples; vLLM is imported inside functions only.
"""

from __future__ import annotations

import torch

from cadence.engine.base import SamplingParams
from cadence.types import Completion

# A nucleus of one token (the argmax), at the highest temperature vLLM takes: renormalised over
# the nucleus the record is exactly 0; the full softmax's is log p(argmax) < 0
CHECK_PARAMS = SamplingParams(max_new_tokens=2, temperature=2.0, top_p=1e-6)


def hook_sampler(worker) -> str:
    """Run by `collective_rpc` on a vLLM worker: its sampler records log softmax(logits / T) of
    the sampled token (the engine keeps `logprobs_mode = "processed_logprobs"`, so that the log-
    probs come from the sampling step). Returns the model runner it hooked: "v1" or "v2"."""
    from vllm.v1.sample.sampler import Sampler

    sampler = worker.model_runner.sampler
    if isinstance(sampler, Sampler):
        _hook_v1(sampler)
        return "v1"
    from vllm.v1.worker.gpu.sample.sampler import Sampler as SamplerV2

    if isinstance(sampler, SamplerV2):
        _hook_v2(sampler)
        return "v2"
    raise RuntimeError(
        f"vLLM's sampler is a {type(sampler).__module__}.{type(sampler).__name__}; cadence "
        "records log softmax(logits / T) through the samplers of vLLM 0.32's model runners "
        "(V1 and V2) only: use vllm==0.32.0 without a custom sampler"
    )


def _hook_v1(sampler) -> None:
    """V1 model runner (vLLM's CPU path): its top-k/top-p sampler receives the logits after
    temperature and returns the sample and the log-probs the sampler records; the sampled
    token's rank is counted without torch.compile (`gather_logprobs_eager`)."""
    topk_topp = sampler.topk_topp_sampler
    sample = topk_topp.forward  # the implementation vLLM chose for this platform
    topk_topp.logprobs_mode = "raw_logprobs"  # it computes no renormalised log-probs of its own

    def forward(logits: torch.Tensor, generators, k, p):
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (R, V), before top-k/top-p
        sampled, _ = sample(logits, generators, k, p)  # top-k/top-p may write into `logits`
        return sampled, logprobs

    # functools' convention for what a wrapper wraps (a test takes the hook off with it)
    forward.__wrapped__ = sample  # type: ignore[attr-defined]
    topk_topp.forward = forward
    sampler.gather_logprobs = gather_logprobs_eager


def gather_logprobs_eager(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
    """vLLM 0.32's `Sampler.gather_logprobs` with the sampled token's rank counted eagerly: its
    own rank count is a `torch.compile`d kernel, which on a CPU costs each process that starts an
    engine a C++ build of several seconds (ranks that cadence never reads). The same tensors."""
    from vllm.v1.outputs import LogprobsTensors

    topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)  # (R, k)
    token_ids = token_ids.unsqueeze(-1)  # (R, 1)
    token_logprobs = logprobs.gather(-1, token_ids)  # (R, 1)
    ranks = (logprobs >= token_logprobs).sum(-1)  # (R,) as vLLM's batched_count_greater_than
    indices = torch.cat((token_ids, topk_indices), dim=1).to(torch.int32)  # (R, 1 + k)
    values = torch.cat((token_logprobs, topk_logprobs), dim=1)  # (R, 1 + k)
    return LogprobsTensors(indices, values, ranks)


def _hook_v2(sampler) -> None:
    """V2 model runner (vLLM's default on GPUs): `_sample_random` receives the logits after
    temperature and returns the sample and the logits whose log softmax the sampler records."""
    sample = sampler._sample_random

    def _sample_random(logits: torch.Tensor, *args):
        sampled, _ = sample(logits.clone(), *args)  # top-k/top-p may write into what they get
        return sampled, logits  # (R, V), before top-k/top-p

    sampler._sample_random = _sample_random


def check_full_softmax(completions: list[Completion]) -> None:
    """Raise unless `completions`, sampled with `CHECK_PARAMS`, carry the full softmax's log-probs
    (a nucleus-renormalised record is exactly 0 on every token)."""
    logprobs = [lp for c in completions for lp in c.logprobs]
    if all(lp == 0.0 for lp in logprobs):
        raise RuntimeError(
            f"vLLM recorded log-probs {logprobs} with top_p = {CHECK_PARAMS.top_p}: renormalised "
            "over the nucleus (a one-token nucleus gives exactly 0), not log softmax(logits / T) "
            "as the learner computes them; use vllm==0.32.0"
        )
