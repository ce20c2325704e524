"""SmolLM2-135M-Instruct through cadence's continuous engine, as `cadence train` wires it:
prompts in its chat template, responses that end at `<|im_end|>`, greedy held-out evaluation
that is transformers' `generate` token for token, and behaviour log-probs the learner
reproduces."""

from __future__ import annotations

import pytest
from smollm2_checks import (
    IM_END,
    LOGPROB_TOL,
    Recording,
    assert_ends_at_im_end,
    learner_batch,
    logprob_gap,
)

from cadence.builder import (
    heldout_evaluator,
    make_task,
    open_rollout_engine,
    sampling_params,
)
from cadence.data import ChatRender
from cadence.models import generation_eos_ids
from cadence.rollout.worker import prompt_ids

pytestmark = pytest.mark.slow


def test_chat_render_tokenizes_as_apply_chat_template(smollm2, smollm2_cfg, smollm2_prompts):
    """The run's held-out prompts (ChatRender's text, tokenized as the run feeds it, without
    added special tokens) are `apply_chat_template([system, user], add_generation_prompt=True)`
    token for token; without a system prompt the template puts SmolLM2's own first."""
    _, tok = smollm2
    system = smollm2_cfg.data.system_prompt
    examples = list(make_task(smollm2_cfg).heldout())
    assert len(examples) == len(smollm2_prompts) == 3
    for example, prompt in zip(examples, smollm2_prompts, strict=True):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": example.question},
        ]
        want = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert prompt_ids(prompt, tok) == list(want)
        assert prompt.text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n")
    got = tok(ChatRender(tok)(examples[0]), add_special_tokens=False)["input_ids"]
    user = [{"role": "user", "content": examples[0].question}]
    assert got == list(tok.apply_chat_template(user, add_generation_prompt=True)["input_ids"])
    assert "named SmolLM" in tok.decode(got)
    # the markers are the single special tokens the model was trained on
    assert got[:3] == [1, 9690, 198]  # <|im_start|> system \n
    assert got[-4:] == [1, 520, 9531, 198]  # <|im_start|> ass istant \n: the reply starts here
    assert got.count(IM_END) == 2  # the system and user turns are closed, the reply's is not


def test_stop_ids_are_the_generation_configs(smollm2_dir, smollm2, smollm2_cfg):
    _, tok = smollm2
    assert generation_eos_ids(smollm2_dir) == (IM_END,)  # generation_config.json's eos_token_id
    assert sampling_params(smollm2_cfg, tok).stop_token_ids == (IM_END,)


def test_greedy_heldout_evaluation_is_transformers_generate(
    smollm2, smollm2_cfg, smollm2_prompts, transformers_greedy
):
    """The run's held-out evaluation (greedy, on the run's engine: the continuous one)."""
    model, tok = smollm2
    assert smollm2_cfg.rollout.engine == "continuous"
    engine, _ = open_rollout_engine(smollm2_cfg, tok, model=model)
    recording = Recording(engine)
    evaluator = heldout_evaluator(smollm2_cfg, model, recording, tok, smollm2_prompts)
    results = evaluator.results()
    ((*completions,),) = [[c for (c,) in out] for out in recording.outputs]
    assert [c.token_ids for c in completions] == transformers_greedy
    assert assert_ends_at_im_end(completions, smollm2_cfg.rollout.max_new_tokens) >= 1
    assert results["response_tokens_mean"] == pytest.approx(
        sum(map(len, transformers_greedy)) / len(transformers_greedy)
    )


def test_continuous_engine_logprobs_are_the_learners(smollm2, smollm2_cfg, smollm2_groups):
    """Sampled groups (temperature 1) from the continuous engine: each token's behaviour
    log-prob equals the learner's recomputation in its shared-prompt layout, fp32."""
    model, tok = smollm2
    completions = [c for g in smollm2_groups for c in g.completions]
    assert assert_ends_at_im_end(completions, smollm2_cfg.rollout.max_new_tokens) >= 1
    assert len({tuple(c.token_ids) for c in completions}) > 1  # really sampled
    gap = logprob_gap(learner_batch(model, tok.pad_token_id, smollm2_groups))
    print(f"continuous engine vs learner: max |log-prob diff| {gap:.2e}")
    assert gap <= LOGPROB_TOL
