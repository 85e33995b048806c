"""Logprobs as the OpenAI API shapes them (the values come from logprobs.py, on the engine thread).

- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}], "refusal": null}``, ``top_logprobs`` the k most likely tokens.
- Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
  in parallel lists; each ``top_logprobs`` entry maps token text to logprob for the k most likely
  tokens plus the chosen one (so up to k + 1, as OpenAI's legacy API did; lm-eval's
  ``local-completions`` reads ``max(top.values())`` to tell a greedy token). The echoed prompt's
  first token has null for both. ``text_offset`` is where each token's text starts in the choice's
  ``text`` (the prompt's included with echo), counting the characters of the tokens' own texts.

A token's text is the tokenizer's decoding of that one id (``Texts.decode``): a byte-level token
that ends inside a UTF-8 character reads as U+FFFD, and ``bytes`` are that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .logprobs import TokenLogprob

TokenText = Callable[[int], str]


class ChatLogprobs:
    def __init__(self, text_of: TokenText) -> None:
        self.text_of, self.content = text_of, []

    def entry(self, token: int, logprob: float) -> dict:
        text = self.text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "backslashreplace"))}

    def add(self, entries: Sequence[TokenLogprob]) -> dict:
        """The shape of these tokens (for a stream chunk); they are also kept for ``full``."""
        part = [
            {**self.entry(e.token, e.logprob), "top_logprobs": [self.entry(t, v) for t, v in e.top]} for e in entries
        ]
        self.content += part
        return {"content": part, "refusal": None}

    def full(self) -> dict:
        return {"content": self.content, "refusal": None}


class CompletionLogprobs:
    KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self, text_of: TokenText) -> None:
        self.text_of, self.offset = text_of, 0
        self.all: dict[str, list] = {key: [] for key in self.KEYS}

    def add(self, entries: Sequence[TokenLogprob]) -> dict:
        part: dict[str, list] = {key: [] for key in self.KEYS}
        for e in entries:
            text = self.text_of(e.token)
            top = None
            if e.logprob is not None:
                top = {self.text_of(t): v for t, v in e.top}
                top.setdefault(text, e.logprob)
            for key, value in zip(self.KEYS, (text, e.logprob, top, self.offset)):
                part[key].append(value)
            self.offset += len(text)
        for key in self.KEYS:
            self.all[key] += part[key]
        return part

    def full(self) -> dict:
        return self.all
