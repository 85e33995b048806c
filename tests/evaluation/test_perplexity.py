"""Strided perplexity == a token-by-token hand computation and == the sliding-window procedure of
transformers' perplexity guide run on a tiny HF Llama; bits per byte; seq2seq exact match ==
greedy decoding; bad input."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T

import torchformer as tfm
from tests.grid import build, variants
from torchformer.evaluation import seq2seq_accuracy, strided_nll, text_perplexity, windows
from torchformer.training.batches import PairBatches

N = 29  # tokens in the "file"


def _decoder():
    return build(variants(["decoder"])[0])


def _hand_nll(model, ids, seq_len, stride):
    """Token by token: target t is scored by the first window (begins 0, stride, 2 stride, ...,
    each seq_len + 1 tokens long) that reaches past every earlier window's end, with that
    window's tokens before t as context."""
    total, covered, begin = 0.0, 1, 0
    while covered < len(ids):
        end = min(begin + seq_len + 1, len(ids))
        for t in range(covered, end):
            logits = model(ids[None, begin:t])[0, -1]
            total -= float(torch.log_softmax(logits.double(), -1)[ids[t]])
        covered, begin = end, begin + stride
    return total


@pytest.mark.parametrize("seq_len, stride", [(8, 8), (8, 3), (8, 1), (6, 5), (N - 1, 4), (N - 1, N - 1)])
def test_strided_equals_hand_computation(seq_len, stride):
    model = _decoder()
    ids = torch.randint(0, model.config.vocab_size, (N,), generator=torch.Generator().manual_seed(2))
    score = strided_nll(model, ids, seq_len=seq_len, stride=stride, batch_size=2)
    assert score.tokens == N - 1  # every token after the first, once
    assert score.nll == pytest.approx(_hand_nll(model, ids, seq_len, stride), rel=1e-5)
    assert score.perplexity == pytest.approx(math.exp(score.nll / (N - 1)), rel=1e-9)


def test_longest_context_is_one_forward():
    model = _decoder()
    ids = torch.randint(0, model.config.vocab_size, (N,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None, :-1])[0].double(), -1)
    one_pass = -float(logp.gather(-1, ids[1:, None]).sum())
    assert strided_nll(model, ids, seq_len=N - 1, stride=1).nll == pytest.approx(one_pass, rel=1e-6)


def _hf_guide(hf_model, input_ids, max_length, stride):
    """The procedure of transformers' guide "Perplexity of fixed-length models": windows of
    max_length moved by stride, labels -100 on the overlap with the previous window, the mean
    loss weighted by the number of labels the (internally shifted) loss really averages."""
    seq_len, nll_sum, n_tokens, prev_end_loc = input_ids.size(1), 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        ids = input_ids[:, begin_loc:end_loc]
        target_ids = ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(ids, labels=target_ids).loss
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(loss) * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


@pytest.mark.parametrize("max_length, stride", [(17, 16), (17, 8), (16, 5), (10, 1)])
def test_matches_transformers_guide_on_tiny_llama(tmp_path, max_length, stride):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf = T.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = tfm.from_hf(tmp_path)
    ids = torch.randint(0, 96, (1, 53), generator=torch.Generator().manual_seed(4))
    nll, n = _hf_guide(hf, ids, max_length, stride)
    score = strided_nll(ours, ids[0], seq_len=max_length - 1, stride=stride)  # seq_len: the context read
    assert score.tokens == n == 52
    assert score.nll == pytest.approx(nll, rel=1e-5)
    assert score.perplexity == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_bits_per_byte_by_hand():
    from torchformer.training.tokenizers import build_tokenizer

    text = "héllo wörld, the night is sweet. " * 3
    tok = build_tokenizer("char", text)
    torch.manual_seed(0)
    cfg = tfm.presets.get("shakespeare-char").replace(vocab_size=tok.vocab_size, n_layers=1, d_model=32)
    model = tfm.build_model(cfg.replace(attention=cfg.attention.__class__(n_heads=2)))
    score = text_perplexity(model, tok, text, seq_len=16, stride=8)
    ids = torch.as_tensor(tok.encode(text))
    assert score.nll == pytest.approx(_hand_nll(model, ids, 16, 8), rel=1e-5)
    scored_bytes = len(text.encode()) - len(text[0].encode())  # the first char is context only
    assert score.n_bytes == scored_bytes
    assert score.bits_per_byte == pytest.approx(score.nll / math.log(2) / scored_bytes, rel=1e-12)
    assert score.to_dict()["bits_per_byte"] == score.bits_per_byte


@pytest.mark.parametrize(
    "n, seq_len, stride, match",
    [
        (8, 8, 4, r"holds 8 tokens, fewer than one window \(seq_len \+ 1 = 9\)"),
        (20, 8, 9, r"stride=9: must be an integer in \[1, seq_len=8\]"),
        (20, 8, 0, r"stride=0"),
        (20, 0, 1, r"seq_len=0: must be an integer >= 1"),
    ],
)
def test_bad_windows(n, seq_len, stride, match):
    with pytest.raises(ValueError, match=match):
        windows(n, seq_len, stride)


def test_seq2seq_accuracy_equals_pair_by_pair_hand_computation():
    """Batched and padded == each pair alone, argmax compared with the target + </s> by hand."""
    v = variants(["encoder_decoder"])[0]
    pad, bos, eos = 0, 1, 2
    model = build(v, pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, decoder_start_token_id=bos)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    pairs = [
        [torch.randint(3, V, (n,), generator=g).tolist() for n in (s, t)]
        for s, t in [(5, 4), (3, 6), (7, 2), (4, 4), (2, 5)]
    ]
    correct = total = exact = 0
    with torch.no_grad():
        for s, t in pairs:  # one pair, no padding
            logits = model(torch.tensor([s + [eos]]), torch.tensor([[bos] + t]))[0]  # (T, V)
            hits = [int(logits[j].argmax()) == want for j, want in enumerate(t + [eos])]
            correct, total, exact = correct + sum(hits), total + len(hits), exact + all(hits)
        s, t = pairs[0]
        logits = model(torch.tensor([s + [eos]]), torch.tensor([[bos] + t]))[0]
    batches = PairBatches(pairs, pairs, batch_size=2, seed=0, pad=pad, bos=bos, eos=eos)
    result = seq2seq_accuracy(model, [batches.collate(pairs[:2]), batches.collate(pairs[2:])])
    assert result["token_accuracy"] == pytest.approx(correct / total)
    assert result["exact_match"] == pytest.approx(exact / len(pairs))
    assert result["pairs"] == 5 and result["tokens"] == total
    # the all-correct case: labels = the model's own teacher-forced argmax for pair 0
    hit_all = {
        "src": torch.tensor([s + [eos]]),
        "src_mask": torch.ones(1, len(s) + 1, dtype=torch.long),
        "tgt": torch.tensor([[bos] + t]),
        "labels": logits.argmax(-1)[None],
    }
    assert seq2seq_accuracy(model, [hit_all]) | {"loss": 0} == {
        "token_accuracy": 1.0,
        "exact_match": 1.0,
        "loss": 0,
        "pairs": 1,
        "tokens": len(t) + 1,
    }
