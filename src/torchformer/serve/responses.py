"""Response and stream-chunk bodies, shaped as the OpenAI API (``text_completion``,
``chat.completion``, ``chat.completion.chunk``): one id and ``created`` per request, the same
id on every chunk, ``finish_reason`` "stop" or "length", usage with total_tokens."""

from __future__ import annotations

import time
import uuid


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class CompletionShape:
    """/v1/completions: choices carry ``text``."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.prompt_ids, self.return_token_ids = model, prompt_ids, return_token_ids

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
        out = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self.with_ids(out, token_ids)

    def with_ids(self, choice: dict, token_ids: list[int] | None) -> dict:
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids  # extension, as vLLM's return_token_ids
        return choice

    def full(self, text: str, finish_reason: str, token_ids: list[int], use: dict) -> dict:
        body = {**self.head(self.object), "choices": [self.choice(text, finish_reason, token_ids)], "usage": use}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(self, text: str, token_ids: list[int] | None, finish_reason: str | None, include_usage: bool) -> dict:
        body = {**self.head(self.chunk_object), "choices": [self.choice(text, finish_reason, token_ids)]}
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def first(self, include_usage: bool) -> dict | None:
        return None  # completions have no opening chunk

    def usage_chunk(self, use: dict) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": use}


class ChatShape(CompletionShape):
    """/v1/chat/completions: choices carry ``message`` (full) or ``delta`` (chunks)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        return self.with_ids(
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}, token_ids
        )

    def chunk(self, text: str, token_ids: list[int] | None, finish_reason: str | None, include_usage: bool) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = self.with_ids(
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}, token_ids
        )
        body = {**self.head(self.chunk_object), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def first(self, include_usage: bool) -> dict | None:
        # OpenAI opens a chat stream with the role and empty content.
        body = {
            **self.head(self.chunk_object),
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        if include_usage:
            body["usage"] = None
        return body
