"""Structured outputs: ``response_format`` (json_object, json_schema) as a token mask.

As vLLM's ``structured_output``: the grammar engine compiles the format once per request (the
compiler caches by schema), each choice (Job) holds its own matcher, the scheduler only knows
that a job has one. Before the sampling processors the mask sets the logits of the tokens the
grammar forbids to -inf (greedy under a schema is deterministic); the model's own logits, which
logprobs report, are not touched (the mask works on a copy). The matcher advances with each
chosen token; once the grammar can only end, the choice ends with finish_reason "stop" (its end
token is not generated). The next mask is computed after the token is accepted, not while the
next forward runs: at 27 us a token (below) against a forward of milliseconds, a thread hand-off
per row per step would cost about what it saves. (A ``maxLength``-bounded string costs more:
~0.6 ms a token at an 8k vocabulary, ~10x an unbounded one.) Greedy rows under a grammar take
one masked argmax together (``masked_argmax``), not a copy, mask and sampler each.

The engine is xgrammar. Measured on this CPU (2 cores, loaded, one thread) at a 128,256-token
byte-level BPE vocabulary over a 5-field nested schema (enum array, bounded integer and number,
pattern string), 73 tokens of output: xgrammar 0.2.8 fills the next-token bitmask in 27 us
median a token (compile 1.8 s for a new schema, then cached; tokenizer info 1.2-1.4 s once per
server); llguidance 1.9.1 in 150-250 us (compile 10 ms, tokenizer 2.8-3.3 s). Both have a ~5-14 ms
first-token tail. The per-token cost, the one every token of every constrained request pays, is
what the issue ranks by, so xgrammar (it is also vLLM's and SGLang's default). Applying the
mask (xgrammar's CPU kernel) costs ~0.5 ms at 128k, whichever engine fills it.

``strict: false`` is constrained too (as vLLM does): the answer validates either way. Left as
xgrammar writes them: a ``pattern`` whose class admits control characters (``.``) may produce
one raw, which JSON parsers refuse.

The request side (``response_format``, the 400s naming the field) imports nothing heavy:
protocol.py calls it from the app, which stays free of torch; xgrammar is imported only when a
server first compiles a format.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import NamedTuple

from .errors import APIError, bad

log = logging.getLogger(__name__)

KINDS = ("text", "json_object", "json_schema")
SCHEMA_KEYS = {"name", "schema", "strict", "description"}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


class ResponseFormat(NamedTuple):
    kind: str  # "json_object" | "json_schema" | "structural_tag" (a required tool call: tools.py)
    schema: str | None  # the JSON schema (or structural tag) as compact JSON text (hashable: Params is frozen)


def response_format(value) -> ResponseFormat | None:
    """The request's ``response_format`` checked (None: plain text), or a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("response_format", f"{value!r} must be an object such as {{'type': 'json_object'}}")
    kind = value.get("type")
    if kind not in KINDS:
        raise bad("response_format.type", f"{kind!r} is not one of {list(KINDS)}")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if set(value) - allowed:
        extra = sorted(set(value) - allowed)
        raise bad("response_format", f"unknown keys {extra} for type {kind!r}; allowed: {sorted(allowed)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", None)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", f"{spec!r} must be an object with name and schema")
    if set(spec) - SCHEMA_KEYS:
        extra = sorted(set(spec) - SCHEMA_KEYS)
        raise bad("response_format.json_schema", f"unknown keys {extra}; allowed: {sorted(SCHEMA_KEYS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad("response_format.json_schema.name", f"{name!r} must be 1-64 letters, digits, '_' or '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict", f"{spec['strict']!r} must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", f"{schema!r}: required, a JSON schema object")
    return ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":")))


# xgrammar 0.2.8 writes the characters of a length-bounded string (maxLength, minLength) as the
# class below on the left, which lets raw control characters through; JSON forbids them unescaped
# (RFC 8259 section 7), and xgrammar's unbounded strings already exclude them: the same class here.
CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")


def compile_error(err: Exception) -> str:
    """xgrammar's message without its '[time] file.cc:line:' prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err).strip()).splitlines()[0][:300]


def real_tokens(width: int, vocab_size: int, stop: list[int]):
    """(W,) int32 bitmask words (xgrammar's layout: token i is bit i % 32 of word i // 32) of the
    tokens the model may choose besides its end tokens: a finished grammar allows none of them."""
    import torch

    bits = torch.zeros(-(-width // 32) * 32, dtype=torch.bool)
    bits[:vocab_size] = True
    bits[[s for s in stop if s < vocab_size]] = False
    words = (bits.view(-1, 32).long() << torch.arange(32)).sum(-1)  # (W,) unsigned 32-bit values
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Grammars:
    """The server's grammar compiler over its tokenizer. ``vocab_size``: the model's (rows of the
    logits); ``stop``: its end tokens. Without one, an id past the vocabulary stands for the
    grammar's end (xgrammar needs one), which no logit can choose: a finished grammar then
    allows no token and the choice ends (Constraint.advance)."""

    def __init__(self, tokenizer, vocab_size: int, stop: frozenset[int]) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        # A copy: the wrapper may change the tokenizer's padding/truncation, which serve reads.
        wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()))
        self.vocab_size, self.stop = vocab_size, sorted(stop) or [vocab_size]
        width = vocab_size + (not stop)
        info = xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=width, stop_token_ids=self.stop)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.xgr, self.real = xgr, real_tokens(width, vocab_size, self.stop)

    def compile(self, fmt: ResponseFormat):
        """The compiled grammar, or a 400 naming what the engine could not compile."""
        # any_whitespace=False: separators are ", " and ": " only, so a model cannot pad forever.
        # json_object: any object, strict_mode off (any keys); a schema: no keys it does not name.
        schema, strict = ('{"type":"object"}', False) if fmt.kind == "json_object" else (fmt.schema, True)
        tag = fmt.kind == "structural_tag"  # tool calls: the call syntax around each function's schema
        try:
            if tag:
                grammar = self.xgr.Grammar.from_structural_tag(fmt.schema)
            else:
                grammar = self.xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
            compiled = self.compiler.compile_grammar(str(grammar).replace(*CHARACTERS))
        except (RuntimeError, ValueError, TypeError) as err:
            param = "tools" if tag else "response_format.json_schema.schema"
            raise bad(param, f"cannot be compiled: {compile_error(err)}") from None
        if Constraint(self, compiled).ended:  # e.g. a character-level vocabulary without '{'
            raise bad(
                "tools" if tag else "response_format", "this model's vocabulary cannot write any text of this format"
            )
        return compiled

    def constraint(self, compiled) -> Constraint:
        return Constraint(self, compiled)


class Stuck(Exception):
    """The grammar needs a token the vocabulary does not have (Constraint.stuck)."""


class Constraint:
    """One choice's matcher and its next-token bitmask (engine thread only)."""

    def __init__(self, grammars: Grammars, compiled) -> None:
        self.xgr, self.vocab_size, self.real = grammars.xgr, grammars.vocab_size, grammars.real
        self.stop = [(s // 32, s % 32) for s in grammars.stop]  # the end tokens' bitmask word and bit
        self.matcher = self.xgr.GrammarMatcher(compiled)
        self.bitmask = self.xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # (1, W) int32
        self.matcher.fill_next_token_bitmask(self.bitmask)

    @property
    def ended(self) -> bool:
        """The mask allows none of the model's tokens but the end ones: nothing more to write."""
        return not bool((self.bitmask[0] & self.real).any())

    def mask(self, logits):
        """logits (1, V) float, in place: what the grammar forbids is -inf."""
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size)
        return logits

    @property
    def stuck(self) -> bool:
        """The mask allows no token at all, not even an end: the vocabulary cannot go on (a
        character vocabulary without a character the format needs next, e.g. '@' of a pattern).
        Looked at only once a choice fails (the all -inf row it then chooses from)."""
        return not bool(self.bitmask.any())

    def advance(self, token: int) -> bool:
        """Accept a chosen token; True once the grammar has ended (or allows only its end).
        Raises Stuck when the mask allowed nothing (the token came from an all -inf row)."""
        if not self.matcher.accept_token(token):
            if self.stuck:
                raise Stuck
            # A bug (its mask allowed it): end the choice, keep the engine.
            log.error("the grammar rejected token %d, which its mask allowed; the choice ends", token)
            return True
        if self.matcher.is_terminated():
            return True
        self.matcher.fill_next_token_bitmask(self.bitmask)
        # Only a grammar that may end here can be left with nothing but its end: the end tokens'
        # bits first (a few us), the whole mask (tens of us at a large vocabulary) only then.
        may_end = any((int(self.bitmask[0, word]) >> bit) & 1 for word, bit in self.stop)
        return may_end and self.ended


def masked_argmax(logits, constraints: list[Constraint], rows: list[int]):
    """The greedy choices (m,) of constrained ``rows`` of a step's logits (n, V): one masked copy
    and one argmax for all of them (what each row's own mask then argmax gives; the processors
    leave greedy logits unchanged). The caller's logits, which logprobs read, are not touched."""
    import torch

    from ..generation.topk import argmax

    picked = logits[rows].float()  # (m, V), a copy
    bitmask = torch.cat([c.bitmask for c in constraints])  # (m, W)
    constraints[0].xgr.apply_token_bitmask_inplace(picked, bitmask, vocab_size=constraints[0].vocab_size)
    return argmax(picked)


class Compilers:
    """The engine's Grammars, made on the first structured request (xgrammar's tokenizer info
    costs a second or more at a large vocabulary; a server that never sees one never pays it)."""

    def __init__(self) -> None:
        self.lock, self.grammars = threading.Lock(), None

    def compile(self, fmt: ResponseFormat, tokenizer, vocab_size: int, stop: frozenset[int]):
        if tokenizer is None:
            raise APIError(
                400,
                "response_format: this model has no tokenizer.json, so it serves token ids only and "
                "cannot constrain text to a format",
                param="response_format",
                code="no_tokenizer",
            )
        with self.lock:
            if self.grammars is None:
                try:
                    self.grammars = Grammars(tokenizer, vocab_size, stop)
                except (RuntimeError, ValueError, TypeError) as err:  # a tokenizer xgrammar cannot read
                    log.exception("the grammar engine cannot use this tokenizer")
                    raise APIError(
                        400,
                        f"response_format: the grammar engine cannot use this model's tokenizer ({err})",
                        param="response_format",
                        code="unsupported_tokenizer",
                    ) from None
        return self.grammars, self.grammars.compile(fmt)
