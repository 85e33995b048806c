"""Chat templates: found in the model folder, rendered in jinja2's sandbox.

Where transformers looks (``tokenization_utils_base``): ``chat_template.jinja`` beside the
tokenizer, else the ``chat_template`` key of ``tokenizer_config.json`` (a string, or a list of
named templates of which "default" is used). Templates are code from the checkpoint, so they
run in ``ImmutableSandboxedEnvironment`` (as transformers does): no attribute access to Python
internals, no mutation of the passed objects. The rendered text is tokenized without adding
special tokens again, since the template writes them itself.

Training renders conversations with it (training/instruct.py) and the server renders requests
(serve/chat.py), so both sit above it; a template that refuses a conversation raises
``TemplateRefused``, which the server's subclass answers as a 400.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TemplateRefused(ValueError):
    """The chat template raised on these messages (``raise_exception`` or a jinja error)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):  # the helper HF templates call to refuse a conversation
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.source = source  # its text tells the model family's tool-call format (tool_formats.detect)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.tool_use: ChatTemplate | None = None  # a folder's "tool_use" template, for requests with tools

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        """``tools``: the request's tools as OpenAI lists them ({"type": "function", "function":
        ...}), the ``tools`` variable of transformers' templates (None: no tools).
        add_generation_prompt: open the assistant's turn (serving); training renders a finished
        conversation without it to find where each answer ends."""
        from jinja2.exceptions import TemplateError

        if tools and self.tool_use is not None:  # as transformers picks a named template
            return self.tool_use.render(messages, tools, add_generation_prompt)
        try:
            return self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as err:
            raise TemplateRefused(f"the model's chat template refused these messages: {err}") from err


def token_text(value) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(folder: str | Path | None, kind: type[ChatTemplate] = ChatTemplate) -> ChatTemplate | None:
    """The folder's chat template as a ``kind`` (the server's answers a refusal with a 400), or None
    when it has none."""
    if folder is None or not Path(folder).is_dir():
        return None
    folder = Path(folder)
    config_file = folder / CONFIG_FILE
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source, named = config.get("chat_template"), {}
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if (folder / TEMPLATE_FILE).is_file():
        source = (folder / TEMPLATE_FILE).read_text()
    if not isinstance(source, str) or not source:
        return None
    specials = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
    chat = kind(source, *specials)
    if isinstance(named.get("tool_use"), str) and named["tool_use"]:
        chat.tool_use = kind(named["tool_use"], *specials)
    return chat
