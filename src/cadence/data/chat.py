"""How an example's prompt becomes the text the model continues: a plain template, or the
tokenizer's chat template (`data.chat_template`).

Read on: docs/data.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cadence.data.base import DEFAULT_TEMPLATE, DataError, Example, make_prompt, render_plain

Render = Callable[[Example], str]


class PlainRender:
    """`template` with {question} replaced; conversations need a chat template."""

    def __init__(self, template: str = DEFAULT_TEMPLATE) -> None:
        make_prompt("", template)  # a template without {question} fails here, not mid-run
        self.template = template

    def __call__(self, example: Example) -> str:
        return render_plain(example, self.template)


class ChatRender:
    """The tokenizer's chat template (or `template`, Jinja text, in its place)."""

    def __init__(
        self,
        tokenizer: Any,
        user_template: str = "{question}",
        system_prompt: str | None = None,
        template: str | None = None,
    ) -> None:
        if template is None and not tokenizer.chat_template:
            raise DataError(
                f"data.chat_template = true, but the tokenizer ({type(tokenizer).__name__}, "
                f"{getattr(tokenizer, 'name_or_path', '?')}) has no chat template: give a Jinja "
                "template file as data.chat_template, or set it to false for plain prompts"
            )
        make_prompt("", user_template)
        self.tokenizer, self.user_template = tokenizer, user_template
        self.system_prompt, self.template = system_prompt, template

    def messages(self, example: Example) -> list[dict[str, str]]:
        if example.messages:
            turns = [{"role": r, "content": c} for r, c in example.messages]
        else:
            turns = [{"role": "user", "content": make_prompt(example.question, self.user_template)}]
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def __call__(self, example: Example) -> str:
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(
                self.messages(example),
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=True,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise DataError(
                f"the chat template failed on a prompt ({type(e).__name__}: {e}); fix the "
                "template (data.chat_template) or the prompt's messages"
            ) from None
        if not isinstance(text, str):
            raise DataError(f"the chat template gave {type(text).__name__}, not text")
        return text


def as_render(template: str | Render) -> Render:
    """A renderer from a plain template string, or the renderer itself."""
    return PlainRender(template) if isinstance(template, str) else template
