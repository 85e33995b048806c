"""One request inside the engine: its prompt, its row's sampling state, and the events it emits.

Sampling reuses generation/ unchanged: the row's logits (1, V) go through the same ``History``
processors and ``choose`` as ``tfm.generate`` with batch 1, with the row's own generator seeded
like generate's, so a request alone draws exactly the noise generate draws. A request for n
choices is n jobs (a group), one row each; choice i of a request with ``seed`` s draws with seed
s + i, so it is exactly what a one-choice request with seed s + i gives. A request with a
``response_format`` gives each job its own grammar matcher (grammar.py): its mask goes on a copy
of the logits before the processors, and the job ends with "stop" once the grammar has ended.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..generation.generate import History
from ..generation.sampling import choose, processed
from .grammar import Stuck
from .logprobs import TokenLogprob
from .metrics import Metrics
from .protocol import APIError, Params
from .text import Texts, TextStream


class Delta(NamedTuple):
    text: str  # newly final text (may be empty while held back)
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for logprobs
    index: int = 0  # the choice


class Prompt(NamedTuple):
    """echo: the prompt's tokens, with their logprobs when asked (sent before the first Delta)."""

    logprobs: tuple[TokenLogprob, ...]
    index: int = 0


class Done(NamedTuple):
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    index: int = 0
    cached_tokens: int = 0  # prompt tokens found in the row's cache, not prefilled (prefix.py)


class Failed(NamedTuple):
    error: APIError


Event = Delta | Prompt | Done | Failed


class Job:
    def __init__(
        self,
        prompt: list[int],
        params: Params,
        max_tokens: int,
        sink: Callable[[Event], None],
        texts: Texts,
        timeout: float,
        index: int = 0,
        grammar: tuple | None = None,
    ) -> None:
        self.id, self.index = uuid.uuid4().hex, index
        self.group = [self]  # the jobs of one request (its n choices); the first one is prefilled
        self.prompt, self.params, self.max_tokens, self.sink = prompt, params, max_tokens, sink
        self.created = time.monotonic()
        self.deadline = self.created + timeout
        self.cancelled = False  # set by the app's thread; read by the engine at each step
        self.ended = False  # its end was sent (set before the sink sees it): no longer running, row not yet freed
        self.text = TextStream(texts, params.stop)
        self.tokens: list[int] = []
        # Set when the job gets a row (engine thread only).
        self.row: int | None = None
        self.pos = 0  # position of the next input token
        self.cached = 0  # prompt tokens reused from the row's cache
        self.last_time = 0.0
        self.generator: torch.Generator | None = None
        self.history: History | None = None
        self.grammar = grammar  # (grammar.Grammars, its compiled format): the job's matcher is made at start
        self.constraint = None  # grammar.Constraint, once started

    @property
    def fast(self) -> bool:
        """Greedy with no history-reading processor: the batched argmax is this row's choice."""
        s = self.params.sampling
        return s.greedy and not s.needs_history and self.grammar is None

    @property
    def masked_greedy(self) -> bool:
        """Greedy under a grammar with no history-reading processor: the argmax of its masked row,
        taken together with the other such rows (grammar.masked_argmax), not one row at a time."""
        s = self.params.sampling
        return s.greedy and not s.needs_history and self.constraint is not None

    def start(self, row: int, vocab_size: int, device: torch.device) -> None:
        self.row, self.pos = row, len(self.prompt)
        s = self.params.sampling
        if not s.greedy:
            # No seed: a fresh one per request, never torch's global RNG (shared by all rows).
            seed = random.randrange(2**63) if self.params.seed is None else self.params.seed + self.index
            self.generator = torch.Generator(device=device).manual_seed(seed)
        if s.needs_history:
            prompt = torch.tensor([self.prompt], device=device)  # (1, T)
            self.history = History(prompt, None, self.max_tokens, vocab_size)
        if self.grammar is not None:
            grammars, compiled = self.grammar
            self.constraint = grammars.constraint(compiled)

    def sample(self, logits: Tensor) -> Tensor:
        """logits (1, V) -> token (1,), exactly as generation.generate.decode does per step."""
        s = self.params.sampling
        logits = logits.float()
        if self.constraint is not None:  # on a copy: the caller's logits give the model's own logprobs
            logits = self.constraint.mask(logits.clone())
        logits = processed(logits, s, self.history)
        tok = choose(logits, s, self.generator)
        if self.history is not None:
            self.history.add(tok)
        return tok

    def accept(self, token: int, eos: frozenset[int], metrics: Metrics, logprob: TokenLogprob | None = None) -> bool:
        """Record a chosen token, emit its text; True when the request has finished."""
        now = time.monotonic()
        metrics.observe(metrics.inter_token if self.tokens else metrics.ttft, now - (self.last_time or self.created))
        self.last_time = now
        try:
            ended = self.constraint is not None and self.constraint.advance(token)  # the grammar has ended
        except Stuck:  # the token came from an all -inf row: nothing the model has may come next
            self.fail(self.unwritable(), metrics)
            return True
        self.tokens.append(token)
        self.pos += 1
        text, stopped = self.text.add(token)
        stopped |= ended
        reason = "stop" if stopped or token in eos else "length" if len(self.tokens) >= self.max_tokens else None
        if reason is not None:
            text += self.text.flush()
        self.sink(Delta(text, [token], () if logprob is None else (logprob,), self.index))
        if reason is not None:
            self.finish(reason, metrics)
        return reason is not None

    def unwritable(self) -> APIError:
        """The 400 of a format this model's vocabulary cannot finish (grammar.Constraint.stuck)."""
        param = "tools" if self.params.response_format.kind == "structural_tag" else "response_format"
        written = self.text.texts.decode(self.tokens)
        return APIError(
            400,
            f"{param}: this model's vocabulary cannot continue text of this format after {written!r}: none "
            "of its tokens may come next (a character-level vocabulary may lack a character the format needs)",
            param=param,
            code="unwritable_format",
        )

    def finish(self, reason: str, metrics: Metrics) -> None:
        self.ended = True
        metrics.finish(reason)
        metrics.tokens(len(self.prompt) if self.index == 0 else 0, len(self.tokens))  # the prompt once
        self.sink(Done(reason, len(self.prompt), len(self.tokens), self.index, self.cached))

    def fail(self, error: APIError, metrics: Metrics) -> None:
        self.ended = True
        metrics.finish("error")
        self.sink(Failed(error))
