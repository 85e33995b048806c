"""Response and stream-chunk bodies, shaped as the OpenAI API (``text_completion``,
``chat.completion``, ``chat.completion.chunk``): one id and ``created`` per request, the same
id on every chunk, ``finish_reason`` "stop" or "length", usage with total_tokens (the prompt
counted once, the completion tokens of all n choices), each choice with its ``index``."""

from __future__ import annotations

import time
import uuid

from .jobs import Delta, Done, Prompt
from .logprob_shapes import ChatLogprobs, CompletionLogprobs, TokenText


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # reused from a row's cache (prefix.py)
    }


class Choice:
    """One choice of a full (not streamed) answer, gathered from its events."""

    def __init__(self, index: int, logprobs) -> None:
        self.index, self.logprobs = index, logprobs  # a ChatLogprobs / CompletionLogprobs, or None
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.done: Done | None = None

    def add(self, event, echo: str) -> None:
        if isinstance(event, Prompt):
            self.text.append(echo)
        elif isinstance(event, Delta):
            self.text.append(event.text)
            self.tokens.extend(event.token_ids)
        else:
            self.done = event
        if self.logprobs is not None and isinstance(event, Prompt | Delta):
            self.logprobs.add(event.logprobs)


class CompletionShape:
    """/v1/completions: choices carry ``text``."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"
    logprobs_class = CompletionLogprobs

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool, text_of: TokenText = str) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.prompt_ids, self.return_token_ids = model, prompt_ids, return_token_ids
        self.text_of = text_of  # a token id's text, for logprobs

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def new_logprobs(self):
        return self.logprobs_class(self.text_of)

    def choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs: dict | None) -> dict:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.with_ids(out, token_ids)

    def with_ids(self, choice: dict, token_ids: list[int] | None) -> dict:
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids  # extension, as vLLM's return_token_ids
        return choice

    def full(self, choices: list[Choice], use: dict) -> dict:
        out = [
            self.choice(
                c.index,
                "".join(c.text),
                c.done.finish_reason,
                c.tokens,
                None if c.logprobs is None else c.logprobs.full(),
            )
            for c in choices
        ]
        body = {**self.head(self.object), "choices": out, "usage": use}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(self, index: int, text: str, token_ids, finish_reason, include_usage: bool, logprobs=None) -> dict:
        choice = self.choice(index, text, finish_reason, token_ids, logprobs)
        body = {**self.head(self.chunk_object), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def first(self, index: int, include_usage: bool) -> dict | None:
        return None  # completions have no opening chunk

    def usage_chunk(self, use: dict) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": use}


class ChatShape(CompletionShape):
    """/v1/chat/completions: choices carry ``message`` (full) or ``delta`` (chunks)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    logprobs_class = ChatLogprobs

    def choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs: dict | None) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        out = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.with_ids(out, token_ids)

    def chunk(self, index: int, text: str, token_ids, finish_reason, include_usage: bool, logprobs=None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {**self.head(self.chunk_object), "choices": [self.with_ids(choice, token_ids)]}
        if include_usage:
            body["usage"] = None
        return body

    def first(self, index: int, include_usage: bool) -> dict | None:
        # OpenAI opens a chat stream with the role and empty content (per choice).
        delta = {"role": "assistant", "content": ""}
        body = {
            **self.head(self.chunk_object),
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
        }
        if include_usage:
            body["usage"] = None
        return body
