"""Text in and out: encoding prompts, incremental decoding with stop strings.

A model folder without tokenizer.json serves token ids only: prompts must be lists of ids and
the returned text is the new ids in decimal, separated by spaces (the ids themselves are in
``token_ids`` with ``return_token_ids``).
"""

from __future__ import annotations

from .protocol import APIError, bad


class Texts:
    """The tokenizer (HF ``tokenizers.Tokenizer``) or, without one, ids written as numbers."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(
                    400,
                    f"{param}: this model has no tokenizer.json, so it serves token ids only: "
                    "send the prompt as a list of ids",
                    param=param,
                    code="no_tokenizer",
                )
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            if not ids:
                raise bad(param, "the prompt encodes to no tokens")
            return ids
        if not all(0 <= i < self.vocab_size for i in prompt):
            raise bad(param, f"token ids must be in [0, vocab_size={self.vocab_size})")
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)


CONTEXT = 4  # ids of left context before the new ones in each decoded window


class TextStream:
    """The text of a growing list of ids, released only when it is final.

    Each token decodes a short window of ids, not the whole list (which would cost O(n) per token,
    O(n^2) per request): the window reads from CONTEXT ids before the last point where the text
    was whole characters, and the new text is the window's decoding minus that of its part already
    seen. Decoding both with the same left context keeps multi-token characters and merges right,
    and keeps the space a SentencePiece decoder strips at a sequence start (or after a skipped
    special token). Text is held back while it ends in an
    incomplete UTF-8 sequence (U+FFFD) or in a prefix of a stop string, which may still complete
    across the next token boundary.
    """

    def __init__(self, texts: Texts, stop: tuple[str, ...]) -> None:
        self.texts, self.stop = texts, stop
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids (up to a stop string once stopped)
        self.sent = 0  # characters of text already released
        self.whole = ""  # the text of the ids up to the last point it ended in whole characters
        self.start = 0  # the window: ids[start:], CONTEXT ids before that point
        self.seen = ""  # the window's decoding up to that point

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; return (newly final text, whether a stop string was reached)."""
        self.ids.append(token)
        window = self.texts.decode(self.ids[self.start :])
        if window.startswith(self.seen):
            self.text = self.whole + window[len(self.seen) :]
        else:  # a decoder whose window text does not extend its prefix's: decode it all
            self.text = self.texts.decode(self.ids)
        if not self.text.endswith("\ufffd"):  # whole characters: the next window reads from here
            self.whole, self.start = self.text, max(0, len(self.ids) - CONTEXT)
            self.seen = self.texts.decode(self.ids[self.start :])
            while not self.seen and self.start > 0:  # only skipped (special) tokens: more context
                self.start = max(0, self.start - CONTEXT)
                self.seen = self.texts.decode(self.ids[self.start :])
        hit = self.first_stop()
        if hit is not None:
            self.text = self.text[:hit]
            return self.release(len(self.text)), True
        safe = len(self.text)
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self.release(safe - self.held_for_stop(safe)), False

    def first_stop(self) -> int | None:
        # A stop string found now ends after the released text, so search from there back.
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def held_for_stop(self, end: int) -> int:
        """Length of the longest tail of text[:end] that is a proper prefix of a stop string."""
        for n in range(min(end - self.sent, max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.text[end - n : end]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        """At the end: everything not yet released."""
        return self.release(len(self.text))
