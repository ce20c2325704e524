"""`cadence serve` on SmolLM2-135M-Instruct, as the command builds it (`build_server`: the model
directory's tokenizer, chat template and stop ids), its app driven in-process by a test client:
a chat request is rendered with the model's own template and answered, greedily, with
transformers' `generate` tokens, ending at `<|im_end|>`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from smollm2_checks import IM_END

from cadence.builder import make_task
from cadence.rollout.worker import prompt_ids
from cadence.serve import build_server, make_app

pytestmark = pytest.mark.slow


def test_serve_answers_a_chat_in_the_models_template_as_transformers_generates(
    smollm2_dir, smollm2, smollm2_cfg, smollm2_prompts, transformers_greedy
):
    _, tok = smollm2
    max_tokens = smollm2_cfg.rollout.max_new_tokens
    server = build_server(str(smollm2_dir), max_num_seqs=4)
    examples = list(make_task(smollm2_cfg).heldout())
    finishes = []
    try:
        with TestClient(make_app(server, token="sesame")) as client:
            for example, prompt, want in zip(
                examples, smollm2_prompts, transformers_greedy, strict=True
            ):
                messages = [
                    {"role": "system", "content": smollm2_cfg.data.system_prompt},
                    {"role": "user", "content": example.question},
                ]
                body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
                headers = {"Authorization": "Bearer sesame"}
                reply = client.post("/v1/chat/completions", json=body, headers=headers)
                assert reply.status_code == 200, reply.text
                got = reply.json()
                # the template's rendering, as the run renders it (test_smollm2_rollout.py
                # checks that against apply_chat_template)
                assert got["prompt_token_ids"] == prompt_ids(prompt, tok)
                assert got["model"] == smollm2_dir.name
                (choice,) = got["choices"]
                assert choice["token_ids"] == want
                stopped = want[-1] == IM_END
                assert choice["finish_reason"] == ("stop" if stopped else "length")
                text = tok.decode(want, skip_special_tokens=True)
                assert choice["message"] == {"role": "assistant", "content": text}
                finishes.append(choice["finish_reason"])
    finally:
        server.close()
    assert "stop" in finishes  # at least one answer ended at <|im_end|>, not at the cap
