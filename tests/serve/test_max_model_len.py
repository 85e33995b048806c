"""max-model-len (issue 25, item 6): the positions a request may use size the KV cache. The default
is what fits in memory (a model built for 1<<20 positions gets a cache of the chosen length, not
the full one, and the start-up log says so), a given length is checked (too large, < 1, or a cache
that cannot fit: one error naming --max-model-len), and a request over it is answered as an
over-long prompt always was (400 context_length_exceeded), with /v1/models saying the limit."""

from __future__ import annotations

import logging

import openai
import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, httpx, serving, tiny_config
from tests.serve.test_errors import envelope
from torchformer.analysis.accounting import kv_cache_bytes
from torchformer.serve import model_len
from torchformer.serve.model_len import STEP, choose

CFG = tiny_config(320).replace(max_seq_len=1 << 20)  # 2 layers, 2 KV heads of 8: 128 B a position in fp32
SLOTS = 2
PER_POSITION = kv_cache_bytes(CFG, 1, SLOTS, torch.float32)  # every slot's share of one position


def test_the_default_is_the_models_length_when_its_cache_fits():
    chosen = choose(CFG, SLOTS, torch.float32, free=2 * PER_POSITION * CFG.max_seq_len)
    assert chosen.value == CFG.max_seq_len and "the model's max_seq_len" in chosen.line


def test_the_default_is_what_fits_in_half_the_free_memory():
    free = 1000 * STEP * PER_POSITION + 12345
    chosen = choose(CFG, SLOTS, torch.float32, free=free)
    assert chosen.value == 500 * STEP  # half, rounded down to a multiple of STEP
    assert chosen.line.startswith(f"max-model-len {500 * STEP}: what fits in half of the")
    assert f"cache {SLOTS} slots x {500 * STEP} positions" in chosen.line and "float32" in chosen.line
    assert f"the model allows {CFG.max_seq_len}" in chosen.line and "--max-model-len to change" in chosen.line


def test_unknown_memory_keeps_the_models_length_and_says_so():
    assert "not checked" in choose(CFG, SLOTS, torch.bfloat16, free=None).line


@pytest.mark.parametrize(
    ("requested", "free", "named"),
    [
        ((1 << 20) + 1, None, ["--max-model-len 1048577", "[1, 1048576]", "max_seq_len"]),
        (0, None, ["--max-model-len 0", "[1, 1048576]"]),
        (1 << 20, 1000 * PER_POSITION, ["--max-model-len 1048576", "free after the weights", "allowed here: 1 to 900"]),
    ],
)
def test_a_given_length_out_of_range_or_memory_is_refused(requested, free, named):
    with pytest.raises(ValueError) as err:
        choose(CFG, SLOTS, torch.float32, requested=requested, free=free)
    assert all(part in str(err.value) for part in named), str(err.value)


def test_when_nothing_fits_the_error_says_what_to_change():
    with pytest.raises(ValueError, match="no KV cache fits.*--slots"):
        choose(CFG, SLOTS, torch.float32, free=PER_POSITION)


@pytest.fixture(scope="module")
def long_model(model_dir):
    """The tiny served model rebuilt for 1<<20 positions (its RoPE table is 32 MB; a full cache
    for 2 slots would be 128 MB: the test's memory allows far less)."""
    torch.manual_seed(0)
    vocab = tfm.load_tokenizer(model_dir).get_vocab_size()
    return tfm.build_model(tiny_config(vocab).replace(max_seq_len=1 << 20)).eval()


def test_the_engine_sizes_its_cache_by_what_fits(model_dir, long_model, monkeypatch, caplog):
    weights = sum(t.numel() * t.element_size() for t in [*long_model.parameters(), *long_model.buffers()])
    per_position = kv_cache_bytes(long_model.config, 1, SLOTS, torch.float32)
    # Memory for the weights' packed copy and 4 * STEP positions of cache: half of that is chosen.
    monkeypatch.setattr(model_len, "available_bytes", lambda: weights + 4 * STEP * per_position)
    caplog.set_level(logging.INFO, logger="torchformer.serve")
    with serving(model_dir, long_model, slots=SLOTS) as (engine, url):
        assert engine.context == engine.cache.max_len == 2 * STEP < long_model.config.max_seq_len
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("max-model-len")]
        assert len(said) == 1 and said[0].startswith(f"max-model-len {2 * STEP}: what fits in half of the"), said
        assert f"the model allows {1 << 20}" in said[0]
        (card,) = httpx.get(f"{url}/v1/models").json()["data"]
        assert card["max_model_len"] == 2 * STEP
        with pytest.raises(openai.BadRequestError) as err:
            client(url).completions.create(model=NAME, prompt=[1] * 10, max_tokens=2 * STEP)
        error = envelope(err.value)
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {2 * STEP}" in error["message"]
        out = client(url).completions.create(model=NAME, prompt=[1] * 10, max_tokens=2 * STEP - 10)
        assert out.choices[0].finish_reason in ("length", "stop")


def test_a_given_length_sizes_the_cache_and_a_bf16_model_keeps_a_bf16_cache(model_dir, tiny):
    model = tfm.load_any(model_dir, dtype=torch.bfloat16)
    with serving(model_dir, model, slots=SLOTS, max_model_len=40) as (engine, url):
        assert engine.context == engine.cache.max_len == 40
        assert {t.dtype for layer in engine.cache.layers for t in (layer.k, layer.v)} == {torch.bfloat16}
        out = client(url).completions.create(model=NAME, prompt="the quick", max_tokens=3)
        assert out.usage.completion_tokens == 3
        response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": [1] * 30, "max_tokens": 11})
        assert response.status_code == 400 and "maximum context length is 40" in response.json()["error"]["message"]


def test_the_engine_refuses_a_length_the_model_was_not_built_for(tiny):
    from tests.serve.conftest import make_engine

    engine = make_engine(tiny, max_model_len=tiny.config.max_seq_len + 1)
    try:
        assert not engine.ready and "--max-model-len 97" in str(engine.error)
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="max_model_len=0"):
        make_engine(tiny, max_model_len=0)
