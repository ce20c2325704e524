"""Prompts rendered through a chat template: the embedded tokenizer's, a Jinja file's, and the
errors of a tokenizer without one or a template that fails."""

from __future__ import annotations

import pytest

from cadence.builder import prompt_render
from cadence.config import ConfigError, load_config
from cadence.data import ChatRender, DataError, Example, PlainRender, to_prompt
from cadence.learner.sft import encode_batch

QUESTION = Example("What is 2 + 3?", "2 + 3 = 5\n#### 5")
CONVERSATION = Example(
    "And 4 + 4?",
    "8",
    messages=(("user", "What is 1 + 1?"), ("assistant", "2"), ("user", "And 4 + 4?")),
)


def test_the_embedded_tokenizer_renders_system_user_and_the_assistant_turn(tokenizer) -> None:
    render = ChatRender(tokenizer, "Q: {question}", system_prompt="Answer after ####.")
    # the embedded template, worked by hand: "<|role|>\ncontent\n" per turn, then the opening
    # of the assistant's turn (add_generation_prompt=True)
    assert render(QUESTION) == (
        "<|system|>\nAnswer after ####.\n<|user|>\nQ: What is 2 + 3?\n<|assistant|>\n"
    )
    assert ChatRender(tokenizer)(QUESTION) == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"


def test_a_conversation_keeps_its_messages_and_gets_the_system_prompt_first(tokenizer) -> None:
    render = ChatRender(tokenizer, "IGNORED {question}", system_prompt="Be brief.")
    assert render(CONVERSATION) == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is 1 + 1?\n<|assistant|>\n2\n"
        "<|user|>\nAnd 4 + 4?\n<|assistant|>\n"
    )
    own = Example("q", "1", messages=(("system", "Mine."), ("user", "q")))
    assert render(own).startswith("<|system|>\nMine.\n<|user|>")  # its own system turn stays


def test_a_jinja_template_overrides_the_tokenizers(tokenizer) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}=> "
    assert ChatRender(tokenizer, template=template)(QUESTION) == "[user] What is 2 + 3? => "


def test_errors_name_the_fix(tokenizer) -> None:
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="has no chat template: give a Jinja template file"):
        ChatRender(tokenizer)
    broken = ChatRender(tokenizer, template="{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError, match="the chat template failed on a prompt"):
        broken(QUESTION)
    raising = ChatRender(tokenizer, template="{{ raise_exception('only one turn, please') }}")
    with pytest.raises(DataError, match="only one turn, please"):
        raising(QUESTION)
    with pytest.raises(DataError, match=r"conversations .* data.chat_template = true"):
        PlainRender()(CONVERSATION)
    with pytest.raises(ValueError, match="no '\\{question\\}' placeholder"):
        PlainRender("Q:")


def test_the_config_builds_the_renderer(tokenizer, tmp_path) -> None:
    cfg = load_config(None, ["data.chat_template=true", "data.system_prompt='S'"])
    assert cfg.data.prompt_template == "{question}"  # the user's message as it is
    assert prompt_render(cfg, tokenizer)(QUESTION).startswith("<|system|>\nS\n<|user|>\nWhat")
    plain = prompt_render(load_config(None, []), tokenizer)
    assert plain(QUESTION) == "Question: What is 2 + 3?\nAnswer: "
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages[-1].content }} ->")
    cfg = load_config(None, [f"data.chat_template='{jinja}'"])
    assert prompt_render(cfg, tokenizer)(QUESTION) == "What is 2 + 3? ->"
    cfg = load_config(None, [f"data.chat_template='{tmp_path / 'absent.jinja'}'"])
    with pytest.raises(ConfigError, match=r"absent\.jinja': no such Jinja template file"):
        prompt_render(cfg, tokenizer)


def test_sft_and_rl_prompts_render_the_same(tokenizer) -> None:
    render = ChatRender(tokenizer, system_prompt="S")
    ids, _, labels = encode_batch([QUESTION], tokenizer, render)
    prompt = tokenizer(to_prompt(QUESTION, "u", 0, render).text, add_special_tokens=False)
    n = len(prompt["input_ids"])
    assert ids[0, :n].tolist() == prompt["input_ids"]
    assert (labels[0, :n] == -100).all() and (labels[0, n:] != -100).any()
