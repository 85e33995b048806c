"""A prompt prefilled in chunks of positions (generation/steps.py ``prompt_hidden``) fills the cache
and gives the next-token logits the whole prompt in one forward gives, over the decoder rows of the
variant grid, the quirk grid (windowed layer kinds, QK-norms, soft-caps), MoE and latent attention,
with left-padded rows; a RoPE table that follows the length runs a prompt longer than its original
length whole, as transformers does."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm
from tests import grid
from tests.generation.test_generate import left_padded
from tests.models.test_grid_quirks import build as quirk_build
from tests.nn.test_moe_model import config as moe_config
from tests.nn.test_moe_model import randomised
from torchformer.configs import DynamicNTK, LongRoPE, RoPE
from torchformer.generation import steps
from torchformer.generation.request import make_request

LENGTHS = (3, 9, 14)  # left-padded to 14 positions


def prefilled(model, ids, mask, rows: int | None, monkeypatch):
    """steps.prefill's (logits (B, V), cache) with PREFILL_ROWS set to ``rows`` (None: one forward)."""
    monkeypatch.setattr(steps, "PREFILL_ROWS", {"cpu": rows or 10**9})
    req = make_request(model, ids, max_new_tokens=4, attention_mask=mask, eos_token_id=None)
    logits, cache, _, _ = steps.prefill(model, req)
    return logits, cache


def assert_same_prefill(model, monkeypatch, rows=(3, 8), tol=1e-5):
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in LENGTHS]  # fmt: skip
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        whole, whole_cache = prefilled(model, ids, mask, None, monkeypatch)
        for r in rows:  # 3 rows of a batch of 3: one position a chunk; 8: two positions
            logits, cache = prefilled(model, ids, mask, r, monkeypatch)
            torch.testing.assert_close(logits, whole, atol=tol, rtol=0)
            for a, b in zip(cache.layers, whole_cache.layers):
                # the last slot holds padding keys (whichever was written last): never attended
                torch.testing.assert_close(a.k[:, :, :-1], b.k[:, :, :-1], atol=tol, rtol=0)
                torch.testing.assert_close(a.v[:, :, :-1], b.v[:, :, :-1], atol=tol, rtol=0)
    return whole


DECODERS = grid.variants(("decoder",))


@pytest.mark.parametrize("v", **grid.params(DECODERS))
def test_chunked_prefill_equals_one_forward_over_the_grid(v, monkeypatch):
    assert_same_prefill(grid.build(v, init_std=0.1), monkeypatch)


@pytest.mark.parametrize("v", [v for v in grid.quirk_variants() if v["arch"] == "decoder"], ids=grid.quirk_id)
def test_chunked_prefill_equals_one_forward_with_quirks(v, monkeypatch):
    assert_same_prefill(quirk_build(v), monkeypatch, tol=2e-5)


@pytest.mark.parametrize(("moe", "mla"), [("deepseek", "mla"), ("qwen2", "mla-full-q"), ("softmax", "none")])
def test_chunked_prefill_equals_one_forward_with_moe_and_latent_attention(moe, mla, monkeypatch):
    assert_same_prefill(randomised(moe_config(moe, mla)), monkeypatch, tol=2e-5)


@pytest.mark.parametrize(
    "scaling",
    [
        DynamicNTK(factor=4.0, original_max_seq_len=8),
        LongRoPE(short_factor=(1.0, 1.2, 1.5, 2.0), long_factor=(3.0, 4.0, 5.0, 6.0), original_max_seq_len=8, factor=3),
    ],
    ids=["dynamic", "longrope"],
)
def test_length_following_rope_runs_a_prompt_past_its_original_length_whole(scaling, monkeypatch):
    """14 positions > the original 8: chunks would rotate the first keys by the short rule; the
    prompt runs whole, so the result equals one forward exactly. Shorter prompts are chunked."""
    cfg = grid.config(DECODERS[0]).replace(positions=RoPE(scaling=scaling))
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        whole, _ = prefilled(model, ids, mask, None, monkeypatch)
        logits, _ = prefilled(model, ids, mask, 3, monkeypatch)
        assert torch.equal(logits, whole)
        calls = []  # the prompt lengths model.hidden was called with
        hidden = model.hidden
        monkeypatch.setattr(model, "hidden", lambda ids, *a: calls.append(ids.shape[1]) or hidden(ids, *a))
        prefilled(model, ids, mask, 3, monkeypatch)
        assert calls == [14]
        calls.clear()
        prefilled(model, ids[:, -8:], mask[:, -8:], 3, monkeypatch)  # within the original length: chunked
        assert calls == [1] * 8


def test_quantized_twins_on_amx_take_wider_chunks_than_16_bit_models(monkeypatch):
    """A prompt's chunk is PREFILL_ROWS rows, and PANEL_CHUNKS times that for a model whose quantized
    twins multiply prefills in bf16 (made W^T once a chunk); a bf16 or fp32 model keeps the narrow
    chunk, which bounds its activations (steps.py: the bf16 peak memory)."""
    from tests.fast.built import built_kernels
    from torchformer.fast.formats import prepare
    from torchformer.fast.quant_panels import PanelLinear

    built_kernels()
    torch.manual_seed(0)
    model = tfm.build_model(grid.config(DECODERS[0])).eval()
    cpu = torch.device("cpu")
    monkeypatch.setattr(steps, "PREFILL_ROWS", {"cpu": 5})
    assert steps.chunk_rows(model, cpu) == 5
    assert steps.chunk_rows(model.to(torch.bfloat16), cpu) == 5
    quantized = tfm.quantize(tfm.build_model(grid.config(DECODERS[0])).eval(), "int8")
    prepare(quantized)
    twins = [m for m in quantized.modules() if isinstance(m, PanelLinear)]
    assert twins, "int8 projections become panel twins where the kernels are built"
    for wide, rows in ((False, 5), (True, 5 * steps.PANEL_CHUNKS)):
        for m in twins:
            monkeypatch.setattr(m, "prefill_bf16", wide)
        assert steps.chunk_rows(quantized, cpu) == rows
    assert steps.chunk_rows(quantized, torch.device("meta")) == steps.PREFILL_ROWS_ELSEWHERE


def test_a_cpu_prefill_gives_the_heaps_free_pages_back_once(monkeypatch):
    """After the prompt's forward (whose activations are then freed) the heap's free pages go back
    to the system once per prefill, before the decode loop (steps.py ``prompt_hidden``)."""
    torch.manual_seed(0)
    model = tfm.build_model(grid.config(DECODERS[0])).eval()
    trims = []
    monkeypatch.setattr(steps, "trim", lambda: trims.append(1) or True)
    ids = torch.randint(1, model.config.vocab_size, (2, 9))
    out = tfm.generate(model, ids, max_new_tokens=3)
    assert trims == [1] and out.shape == (2, 12)
