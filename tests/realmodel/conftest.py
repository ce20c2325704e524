"""The real-model tests' shared pieces: SmolLM2-135M-Instruct (tests/conftest.py: smollm2_dir)
loaded once per session, a run config that points at it with its chat template, three held-out
arithmetic prompts rendered as `cadence train` renders them, transformers' greedy answers, and
two groups sampled by the continuous engine as a run samples them.

They run on one torch thread (`one_thread`). Decoding a batch of three with a 135 M model gains
little from a second thread, and where the two cores are already busy (two pytest-xdist workers,
or other jobs) a second OpenMP thread spins: measured on a busy 2-core machine, greedy decoding
of 3 prompts x 16 tokens cost 36 s of CPU on two threads against 4 s on one.
"""

from __future__ import annotations

import pytest
import torch
from smollm2_checks import one_thread, run_config

from cadence.builder import (
    heldout_set,
    open_rollout_engine,
    rollout_worker,
    sampling_params,
)
from cadence.models import load_model, load_tokenizer, max_positions
from cadence.rollout.worker import prompt_ids


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer), in eval mode. Tests train copies of it; a backward through it (the
    learner's recomputation) drops its gradients and leaves it in eval mode again."""
    return load_model(smollm2_dir).eval(), load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_cfg(smollm2_dir):
    """The run config the tests share (smollm2_checks.run_config)."""
    return run_config(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2, smollm2_cfg):
    """The run's three held-out prompts (rendered with the chat template)."""
    model, tokenizer = smollm2
    return heldout_set(smollm2_cfg, tokenizer, max_positions(model))


@pytest.fixture(scope="session")
def transformers_greedy(smollm2, smollm2_cfg, smollm2_prompts) -> list[list[int]]:
    """`model.generate(do_sample=False)` of each held-out prompt, stopping at the run's stop
    ids, at most `rollout.max_new_tokens` new tokens."""
    model, tok = smollm2
    sampling = sampling_params(smollm2_cfg, tok)
    out = []
    with torch.no_grad(), one_thread():
        for p in smollm2_prompts:
            ids = prompt_ids(p, tok)
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=sampling.max_new_tokens,
                do_sample=False,
                eos_token_id=list(sampling.stop_token_ids),
                pad_token_id=tok.pad_token_id,
            )
            out.append(generated[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="session")
def smollm2_groups(smollm2, smollm2_cfg, smollm2_prompts):
    """Two groups of 4 responses (temperature 1, at most 16 tokens) of the first two held-out
    prompts, sampled by the continuous engine as a run's worker samples them, at version 0."""
    model, tok = smollm2
    engine, _ = open_rollout_engine(smollm2_cfg, tok, model=model, kind="continuous")
    worker = rollout_worker(smollm2_cfg, engine, tok)
    with torch.no_grad(), one_thread():
        return worker.rollout(smollm2_prompts[:2], iteration=0, version=0)
