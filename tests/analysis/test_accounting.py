"""Accounting against hand computation: parameters for every preset, KV bytes and FLOPs for two
configs written out by hand, activations against the tensors autograd actually saves."""

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm
from torchformer.analysis import (
    activation_bytes,
    count_params,
    flops_per_token,
    kv_cache_bytes,
    matmul_peak_flops,
    mfu,
    param_breakdown,
    training_bytes,
)
from torchformer.configs import GATED, Learned


def params_by_formula(cfg: tfm.ModelConfig) -> int:
    """Parameters from the config fields alone (an independent formula, not the model)."""
    if cfg.moe is not None or cfg.mla is not None:  # experts / MLA: written out in test_presets (issue 17)
        from tests.test_presets import expected_params

        return expected_params(cfg)
    d, h, kv, e, ff, v = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    ab, ob, mb = cfg.attention.bias, cfg.attention.o_bias, cfg.block.bias
    norm = 2 * d if cfg.block.norm == "layernorm" and cfg.block.norm_bias else d
    attn = 2 * d * h * e + 2 * d * kv * e + (h * e + 2 * kv * e if ab else 0) + (d if ob else 0)
    n_mats = 3 if cfg.block.mlp in GATED else 2
    mlp = n_mats * d * ff + ((n_mats - 1) * ff + d if mb else 0)
    qk_norm = {None: 0, "head": 2 * e, "width": (h + kv) * e}[cfg.attention.qk_norm]  # Qwen3/Gemma 3, OLMo 2
    layer = attn + qk_norm + mlp + (4 if cfg.block.norm_placement == "sandwich" else 2) * norm  # Gemma 2/3: 4
    pos = (cfg.max_seq_len + cfg.positions.offset) * d if isinstance(cfg.positions, Learned) else 0
    if isinstance(cfg.positions, tfm.RelativeBias):  # one (buckets, heads) table per stack (T5)
        pos = cfg.positions.num_buckets * h
    embed = v * d + pos + cfg.n_token_types * d + (norm if cfg.embed_norm else 0)
    final = norm if cfg.has_final_norm else 0
    head = (0 if cfg.tie_embeddings else v * d) + (v if cfg.final_logits_bias else 0)
    if cfg.arch == "encoder":
        return embed + cfg.n_layers * layer + final
    if cfg.arch == "decoder":
        return embed + cfg.n_layers * layer + final + head
    tgt_embed = embed if not cfg.share_embeddings else embed - v * d
    cross = attn + norm
    return embed + tgt_embed + cfg.n_layers * layer + final + cfg.decoder_layers * (layer + cross) + final + head


@pytest.mark.parametrize("name", tfm.presets.names())
def test_count_params_equals_numel_formula_and_breakdown_for_every_preset(name):
    cfg = tfm.presets.get(name)
    n = count_params(cfg)
    assert n == params_by_formula(cfg)
    assert sum(param_breakdown(cfg).values()) == n


def test_published_parameter_counts():
    assert count_params(tfm.presets.get("gpt2-small")) == 124_439_808
    assert count_params(tfm.presets.get("llama2-7b")) == 6_738_415_616
    assert count_params(tfm.presets.get("llama3-8b")) == 8_030_261_248


def test_count_params_equals_numel_of_a_real_model():
    cfg = tfm.presets.get("llama-tiny")
    model = tfm.build_model(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_breakdown_of_llama2_7b_by_hand():
    parts = param_breakdown(tfm.presets.get("llama2-7b"))
    assert parts == {
        "embeddings": 32000 * 4096,
        "attention": 32 * 4 * 4096 * 4096,
        "mlp": 32 * 3 * 4096 * 11008,
        "norms": (2 * 32 + 1) * 4096,
        "positions": 0,
        "lm_head": 32000 * 4096,
    }


def test_kv_cache_bytes_by_hand():
    llama3 = tfm.presets.get("llama3-8b")
    assert kv_cache_bytes(llama3, 8192, 1, torch.bfloat16) == 2 * 32 * 8 * 128 * 8192 * 1 * 2 == 2**30
    gpt2 = tfm.presets.get("gpt2-small")
    assert kv_cache_bytes(gpt2, 1024, 4, "float32") == 2 * 12 * 12 * 64 * 1024 * 4 * 4
    mha = llama3.replace(attention={"n_kv_heads": 32})
    assert Fraction(kv_cache_bytes(llama3, 8192, 1, "bf16"), kv_cache_bytes(mha, 8192, 1, "bf16")) == Fraction(1, 4)
    assert kv_cache_bytes(tfm.presets.get("bert-base"), 512) == 0


def test_kv_cache_bytes_matches_an_allocated_cache():
    cfg = tfm.presets.get("llama-tiny")
    cache = tfm.build_model(cfg).new_cache(3, 100)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    # the static cache keeps one extra (trash) slot per row for padding tokens
    assert allocated == kv_cache_bytes(cfg, 101, 3)


def test_flops_per_token_by_hand_gpt2_small():
    T = 1024
    per_layer = 4 * 768 * 768 + 2 * 768 * 3072
    forward = 2 * (12 * per_layer + 768 * 50257) + 4 * 12 * T * 768
    f = flops_per_token(tfm.presets.get("gpt2-small"), T)
    assert (f.forward, f.training) == (forward, 3 * forward) == (284_812_800, 854_438_400)


def test_flops_per_token_by_hand_llama3_8b():
    T = 8192
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024  # q, o full; k, v at 8 of 32 heads
    mlp = 3 * 4096 * 14336
    forward = 2 * (32 * (attn + mlp) + 4096 * 128256) + 4 * 32 * T * 32 * 128
    assert flops_per_token(tfm.presets.get("llama3-8b"), T).forward == forward == 19_304_284_160


def test_flops_encoder_decoder_counts_cross_attention():
    cfg = tfm.presets.get("vanilla-base")
    T, d = 100, 512
    layer = 4 * d * d + 2 * d * 2048
    forward = 2 * (6 * layer + 6 * (layer + 4 * d * d) + d * 37000) + 4 * (6 + 2 * 6) * T * d
    assert flops_per_token(cfg, T).forward == forward


@pytest.mark.parametrize("name", ["shakespeare-char", "llama-tiny"])
def test_activation_estimate_within_20_percent_of_saved_tensors(name):
    cfg = tfm.presets.get(name)
    model = tfm.build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (4, 128))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    measured = sum(saved.values())
    assert 0.8 < activation_bytes(cfg, 128, 4) / measured < 1.2


def test_training_bytes_adds_up():
    cfg = tfm.presets.get("llama-tiny")
    n = count_params(cfg)
    fp32 = training_bytes(cfg, 64, 2, torch.float32)
    assert (fp32["weights"], fp32["gradients"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)
    bf16 = training_bytes(cfg, 64, 2, "bf16")
    assert (bf16["weights"], bf16["optimizer"]) == (2 * n, 12 * n)  # + fp32 master weights
    assert fp32["total"] == sum(v for k, v in fp32.items() if k != "total")


def test_mfu_and_peak():
    assert mfu(1000.0, 6e6, 1e10) == pytest.approx(0.6)
    rng = torch.get_rng_state()
    assert matmul_peak_flops(size=128, repeats=2) > 1e8
    assert torch.equal(torch.get_rng_state(), rng)  # its matrices move no random stream (a run's dropout)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)


def test_a_training_process_measures_the_peak_twice_and_keeps_the_best(monkeypatch):
    """A run's start and first evaluation measure; later evaluations and runs reuse the best."""
    from torchformer.training import session

    measured = iter([3e9, 5e9, 4e9])
    calls = []
    monkeypatch.setattr(session, "_PEAKS", {})
    monkeypatch.setattr(session, "matmul_peak_flops", lambda device: calls.append(device) or next(measured))
    cpu = torch.device("cpu")
    assert [session.measured_peak(cpu) for _ in range(4)] == [3e9, 5e9, 5e9, 5e9]
    assert calls == [cpu, cpu]
    torch.set_num_threads(torch.get_num_threads() + 1)  # another thread count has a peak of its own
    assert session.measured_peak(cpu) == 4e9 and len(calls) == 3


def test_bad_arguments_name_themselves():
    cfg = tfm.presets.get("llama-tiny")
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token(cfg, 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        kv_cache_bytes(cfg, 8, 0)
    with pytest.raises(ValueError, match="dtype='float8'"):
        kv_cache_bytes(cfg, 8, 1, "float8")
