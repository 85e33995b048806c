"""The chat template as the server renders it: text/chat_template.py's (shared with training),
with a conversation the template refuses answered as a 400 naming ``messages``."""

from __future__ import annotations

from pathlib import Path

from ..text import chat_template as shared
from .errors import APIError


class ChatTemplate(shared.ChatTemplate):
    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        try:
            return super().render(messages, tools, add_generation_prompt)
        except shared.TemplateRefused as err:
            raise APIError(400, str(err), param="messages") from err


def load_chat_template(folder: str | Path | None) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none (chat requests then answer 400)."""
    return shared.load_chat_template(folder, ChatTemplate)
