"""``generate`` and ``stream``: prefill once, then one token per step through the static KV cache.

Legend: B batch, T prompt length, N new tokens, V vocabulary. Every argument is checked once at
the boundary (``request.py``); the loop itself runs the models' unchecked ``logits`` path and
the pure processors of ``sampling.py``, with no per-token validation or host round trip other
than the all-rows-finished test when ``eos_token_id`` is given.

Finished rows: a row that produced an EOS id keeps it and is padded afterwards with
``pad_token_id`` (default: the config's pad_token_id, else the first EOS id, else 0). Generation
stops early once every row has finished, so the output can be shorter than T + max_new_tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ..fast import native_step
from ..fast.scope import packed
from .request import Request, make_generator, make_request, sampling_options, speculative_k
from .sampling import Sampling, choose, process, processed
from .speculative import SpeculativeStream
from .steps import check_compile_settings, loop_step, prefill


class History:
    """Tokens so far (B, L) and seen-token flags (B, V), kept only when a processor reads them."""

    def __init__(self, prefix: Tensor, mask: Tensor | None, max_new: int, vocab_size: int) -> None:
        B, T = prefix.shape
        self.tokens = torch.zeros(B, T + max_new, dtype=prefix.dtype, device=prefix.device)
        self.valid = torch.zeros(B, T + max_new, dtype=torch.bool, device=prefix.device)
        self.tokens[:, :T] = prefix
        self.valid[:, :T] = True if mask is None else mask.bool()
        # Padding ids are not "seen"; scatter_add, as a padding id may also occur as a real token.
        counts = torch.zeros(B, vocab_size, dtype=torch.long, device=prefix.device)
        self.seen = counts.scatter_add_(1, prefix, self.valid[:, :T].long()) > 0
        self.length = T

    def add(self, tok: Tensor) -> None:
        self.tokens[:, self.length] = tok
        self.valid[:, self.length] = True
        self.seen.scatter_(1, tok[:, None], True)
        self.length += 1

    def process(self, logits: Tensor, s: Sampling) -> Tensor:
        n = self.length
        return process(logits, s, seen=self.seen, tokens=self.tokens[:, :n], valid=self.valid[:, :n])


def decode(model, req: Request, s: Sampling, generator, compiled: bool, scores: bool = False) -> Iterator:
    """Yield each new token (B,), or with ``scores`` (token, processed logits (B, V)) pairs, the
    logits what the token was chosen from; finished rows yield pad_token_id. The tokens are normal
    tensors (the loop's cloned as they leave inference mode); the loop's logits inference ones."""
    with contextlib.ExitStack() as scope:
        with torch.inference_mode():
            # A batch's few-row products run over packed weights (fast/panels.py), freed at the end.
            scope.enter_context(packed(model, req.input_ids.shape[0]))
            logits, cache, pos, prefix = prefill(model, req, bucketed=compiled)
            step = loop_step(model, req.seq2seq, compiled, prefix.shape[0])
            native = s.greedy and not s.needs_history and native_step.takes(step, cache)
        if native:
            # The native step's own loop (fast/native_step.py): one call a token, which chooses it
            # too; no torch op, inference-mode switch or Python frame between two steps. One row,
            # so an EOS ends it.
            stop = set() if req.eos is None else set(req.eos.tolist())
            yield from step.greedy(logits.float(), pos, req.max_new_tokens, stop, scores)
        else:
            for tok, processed_logits in loop(model, req, s, generator, step, logits, cache, pos, prefix):
                tok = tok.clone() if tok.is_inference() else tok
                yield (tok, processed_logits) if scores else tok


# inference_mode (not no_grad) skips autograd bookkeeping on every op: ~10-15% of an eager step
# on CPU. It is active only while the generator runs, not in the caller's code between tokens.
@torch.inference_mode()
def loop(model, req: Request, s: Sampling, generator, step, logits: Tensor, cache, pos: Tensor, prefix: Tensor):
    """``decode``'s loop over ``step`` from the prompt's logits: (token (B,), its logits (B, V))."""
    history = None
    if s.needs_history:
        mask = None if req.seq2seq else req.attention_mask
        history = History(prefix, mask, req.max_new_tokens, logits.shape[-1])
    finished = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
    for i in range(req.max_new_tokens):
        logits = processed(logits.float(), s, history)
        tok = choose(logits, s, generator)
        if req.eos is not None:
            tok = tok.masked_fill(finished, req.pad_token_id)
            finished = finished | torch.isin(tok, req.eos)
        if history is not None:
            history.add(tok)
        yield tok, logits
        if i + 1 == req.max_new_tokens or (req.eos is not None and bool(finished.all())):
            return
        logits = step(model, tok[:, None], pos, cache)
        pos = pos + 1


def stream(
    model,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
    seed: int | None = None,
    compile: bool = False,
    draft_model=None,
    num_draft_tokens: int | None = None,
    prompt_lookup_num_tokens: int | None = None,
) -> Iterator[Tensor]:
    """Like ``generate``, but yields each new token (B,) as soon as it is chosen; the arguments
    are checked when ``stream`` is called, not at the first ``next``."""
    return open_decode(**dict(locals()))[1]  # locals() here = exactly the arguments


def open_decode(
    model,
    input_ids,
    *,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition_penalty,
    no_repeat_ngram_size,
    seed,
    compile,
    draft_model=None,
    num_draft_tokens=None,
    prompt_lookup_num_tokens=None,
    **request,
) -> tuple[Request, Iterator[Tensor]]:
    """Validate everything, then return the request and the (lazy) token iterator."""
    req = make_request(model, input_ids, **request)
    s = sampling_options(temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size)
    k = speculative_k(model, req, s, draft_model, num_draft_tokens, prompt_lookup_num_tokens)
    generator = make_generator(seed, input_ids.device)
    check_compile_settings(bool(compile))
    if k is not None:
        return req, SpeculativeStream(model, req, s, generator, bool(compile), draft_model, k)
    tokens = decode(model, req, s, generator, bool(compile))
    return req, tokens


def generate(
    model,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
    seed: int | None = None,
    compile: bool = False,
    draft_model=None,
    num_draft_tokens: int | None = None,
    prompt_lookup_num_tokens: int | None = None,
) -> Tensor:
    """Continue each row of input_ids (B, T); returns (B, T + N) with N <= max_new_tokens.

    DecoderLM: input_ids is the prompt, left-padded when rows differ in length (attention_mask
    (B, T), 0 = padding); each row's output equals generating that prompt alone. EncoderDecoder:
    input_ids is the source (attention_mask marks its padding, on the right: the encoder counts
    positions from the first column); the output is (B, 1 + N): the decoder start token
    (config.decoder_start_token_id unless given) and N tokens.

    temperature 0 is greedy; otherwise tokens are sampled after the processors of
    ``torchformer.generation.sampling`` (repetition penalty, n-gram block, temperature, top-k,
    top-p, min-p, in that order). ``seed`` makes sampling reproducible without touching torch's
    global RNG. ``compile=True`` compiles the one-token step once (prefill runs eager).

    Speculative decoding (``generation.speculative``, batch 1, DecoderLM): ``draft_model=small``
    guesses ``num_draft_tokens`` (default 3) tokens per round, or ``prompt_lookup_num_tokens=k``
    copies k tokens from an earlier occurrence of the last n-gram; the target checks them in one
    forward. Greedy output equals plain greedy; sampled output follows the target's distribution.
    Rows that emit an id of ``eos_token_id`` stop and are padded (module docstring).
    """
    req, tokens = open_decode(**dict(locals()))
    new = torch.stack(list(tokens), dim=1)  # (B, N)
    if req.seq2seq:
        return torch.cat([torch.full_like(new[:, :1], req.start_token_id), new], dim=1)  # (B, 1 + N)
    return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)  # (B, T + N)
