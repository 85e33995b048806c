"""Boundary checks for generate / stream / beam_search: every argument is checked once, here,
before any tensor work, and the loops then run unchecked. Errors name the argument, its value
and what is allowed."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.checks import check_ids
from ..models.decoder import DecoderLM
from ..models.encoder_decoder import EncoderDecoder
from .sampling import Sampling


@dataclass(frozen=True)
class Request:
    """What a decode loop needs, validated."""

    input_ids: Tensor  # (B, T): the prompt (decoder) or the source (encoder-decoder)
    attention_mask: Tensor | None  # (B, T) or None
    max_new_tokens: int
    eos: Tensor | None  # (n_eos,) ids that finish a row
    pad_token_id: int  # written after a row has finished
    start_token_id: int | None  # encoder-decoder only: the decoder's first input
    seq2seq: bool


def check_model(model) -> None:
    if not isinstance(model, DecoderLM | EncoderDecoder):
        raise TypeError(f"model must be a DecoderLM or an EncoderDecoder, got {type(model).__name__}")
    if model.training:
        warnings.warn("generating with a model in training mode (dropout on): call model.eval() first", stacklevel=3)


def check_int(name: str, value, lo: int, allowed: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r}: {allowed or f'must be an integer >= {lo}'}")


def check_float(name: str, value, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r}: {allowed}")


def sampling_options(temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size) -> Sampling:
    check_float("temperature", temperature, lambda t: t >= 0, "must be >= 0 (0 = greedy)")
    if top_k is not None:
        check_int("top_k", top_k, 1, "must be None or an integer >= 1")
    if top_p is not None:
        check_float("top_p", top_p, lambda p: 0 < p <= 1, "must be None or in (0, 1]")
    if min_p is not None:
        check_float("min_p", min_p, lambda p: 0 <= p <= 1, "must be None or in [0, 1]")
    check_float("repetition_penalty", repetition_penalty, lambda r: r > 0, "must be > 0 (1.0 = off)")
    check_int("no_repeat_ngram_size", no_repeat_ngram_size, 0, "must be an integer >= 0 (0 = off)")
    return Sampling(float(temperature), top_k, top_p, min_p, float(repetition_penalty), int(no_repeat_ngram_size))


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list | tuple) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{name}={value!r}: must be None, a token id or a non-empty list of token ids")
    if not all(0 <= i < vocab_size for i in ids):
        raise ValueError(f"{name}={value!r}: ids must be in [0, vocab_size={vocab_size})")
    return list(ids)


def check_attention_mask(mask, input_ids: Tensor, seq2seq: bool) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {tuple(input_ids.shape)}; "
            "they must match"
        )
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    if not mask.any(dim=1).all():
        raise ValueError("attention_mask has a row with no real token: every prompt needs at least one")
    # A decoder continues each row from its last column, so padding must be on the left.
    if not seq2seq and not (mask[:, 1:] >= mask[:, :-1]).all():
        raise ValueError("attention_mask must be left-padded for a decoder (0s before 1s in every row)")


def make_request(
    model,
    input_ids,
    *,
    max_new_tokens,
    attention_mask,
    eos_token_id,
    pad_token_id=None,
    decoder_start_token_id=None,
) -> Request:
    """Check everything shared by generate, stream and beam_search."""
    check_model(model)
    cfg = model.config
    seq2seq = isinstance(model, EncoderDecoder)
    check_ids(input_ids, "input_ids", cfg.vocab_size, cfg.max_seq_len)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_attention_mask(attention_mask, input_ids, seq2seq)
    # The decoder's sequence: the prompt (decoder) or the start token (encoder-decoder), then new tokens.
    used = 1 if seq2seq else input_ids.shape[1]
    if used + max_new_tokens > cfg.max_seq_len:
        what = "the decoder start token" if seq2seq else f"the prompt length {used}"
        raise ValueError(
            f"{what} + max_new_tokens={max_new_tokens} = {used + max_new_tokens} exceeds "
            f"max_seq_len={cfg.max_seq_len} of this model"
        )
    eos = None if eos_token_id is None else token_ids("eos_token_id", eos_token_id, cfg.vocab_size)
    pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0  # only ever written after a row's EOS, so eos is the natural filler
    token_ids("pad_token_id", pad, cfg.vocab_size)
    start = None
    if seq2seq:
        start = cfg.decoder_start_token_id if decoder_start_token_id is None else decoder_start_token_id
        if start is None:
            raise ValueError(
                "decoder_start_token_id=None and the model config has none: pass decoder_start_token_id=ID"
            )
        token_ids("decoder_start_token_id", start, cfg.vocab_size)
    return Request(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos=None if eos is None else torch.tensor(eos, device=input_ids.device),
        pad_token_id=pad,
        start_token_id=start,
        seq2seq=seq2seq,
    )


def make_generator(seed, device: torch.device) -> torch.Generator | None:
    """A private generator from ``seed`` (same seed, same samples); None = torch's global RNG."""
    if seed is None:
        return None
    check_int("seed", seed, 0, "must be None or an integer >= 0")
    return torch.Generator(device=device).manual_seed(seed)


DEFAULT_DRAFT_TOKENS = 3  # k + 1 = 4 verified rows: the most nn.linear's compiled few-row path takes


def speculative_k(model, req: Request, s: Sampling, draft_model, num_draft_tokens, prompt_lookup_num_tokens):
    """k (tokens guessed per round) for speculative decoding, or None for plain decoding; every
    speculative argument checked against the model and the request."""
    if draft_model is None and prompt_lookup_num_tokens is None:
        if num_draft_tokens is not None:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} needs draft_model=...; without one, leave it None")
        return None
    if draft_model is not None and prompt_lookup_num_tokens is not None:
        raise ValueError("draft_model and prompt_lookup_num_tokens are two ways to guess tokens: pass one of them")
    if req.seq2seq:
        raise ValueError("speculative decoding needs a DecoderLM target; model is an EncoderDecoder")
    if req.input_ids.shape[0] != 1:
        batch = req.input_ids.shape[0]
        raise ValueError(f"speculative decoding runs one prompt at a time: input_ids has batch {batch}, must be 1")
    if s.needs_history:
        raise ValueError(
            "speculative decoding supports temperature, top_k, top_p and min_p; "
            f"repetition_penalty={s.repetition_penalty} / no_repeat_ngram_size={s.no_repeat_ngram_size} must stay off"
        )
    if prompt_lookup_num_tokens is not None:
        check_int("prompt_lookup_num_tokens", prompt_lookup_num_tokens, 1, "must be None or an integer >= 1")
        if num_draft_tokens is not None:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens!r} sizes a draft model's guesses; prompt lookup's count "
                f"is prompt_lookup_num_tokens={prompt_lookup_num_tokens}: leave num_draft_tokens None"
            )
        return prompt_lookup_num_tokens
    k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
    check_int("num_draft_tokens", k, 1, "must be None or an integer >= 1")
    if not isinstance(draft_model, DecoderLM):
        raise TypeError(f"draft_model must be a DecoderLM, got {type(draft_model).__name__}")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"draft_model has vocab_size={draft_model.config.vocab_size} but the target has "
            f"vocab_size={model.config.vocab_size}; they must share one vocabulary"
        )
    draft_device = next(draft_model.parameters()).device
    if draft_device != req.input_ids.device:
        raise ValueError(
            f"draft_model is on {draft_device} but input_ids (and the target) are on {req.input_ids.device}: "
            "move the draft to the same device"
        )
    if draft_model.config.max_seq_len < req.input_ids.shape[1]:
        raise ValueError(
            f"draft_model max_seq_len={draft_model.config.max_seq_len} is shorter than the prompt "
            f"({req.input_ids.shape[1]} tokens)"
        )
    return k
