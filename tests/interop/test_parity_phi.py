"""Phi-2 (transformers' phi) against transformers: one LayerNorm feeding attention and MLP in
parallel, biases everywhere (the head's too), partial rotary (0.5 by default, 0.25 here), GQA,
tied and untied heads; both round trips. The family is one table in interop/hf_phi.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers as T

import torchformer as tfm
from torchformer.configs import AttentionConfig, BlockConfig
from torchformer.interop import config_from_hf, from_hf, to_hf

from . import family_checks as fc

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,  # tiny models at 0.02 repeat one token under greedy decoding
)
SPECS = {
    "phi": dict(),  # PhiConfig's default partial_rotary_factor 0.5, no key written
    "phi-gqa-tied-quarter": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        layer_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
    ),
}


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    @functools.cache
    def make(name: str):  # (folder, the random HF model saved there), once per module
        folder = tmp_path_factory.mktemp(name)
        return folder, fc.saved(T.PhiForCausalLM, T.PhiConfig(**BASE, **SPECS[name]), folder)

    return make


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_hf_on_a_padded_batch(phi, name):
    folder, hf = phi(name)
    assert fc.decoder_max_diff(folder, hf, 128) < fc.TOL


def test_config_translation(phi):
    cfg = config_from_hf(phi("phi")[0])
    assert (cfg.block.norm_placement, cfg.block.norm, cfg.block.mlp) == ("parallel_shared", "layernorm", "gelu_tanh")
    assert cfg.positions.fraction == 0.5 and cfg.attention.bias and cfg.block.bias and cfg.final_logits_bias
    gqa = config_from_hf(phi("phi-gqa-tied-quarter")[0])
    assert (gqa.n_kv_heads, gqa.positions.fraction, gqa.positions.base, gqa.tie_embeddings) == (2, 0.25, 500.0, True)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_16_tokens_match_generate(phi, name):
    folder, hf = phi(name)
    fc.decoder_greedy_equal(folder, hf, 128)


@pytest.mark.parametrize("name", list(SPECS))
def test_hf_round_trip_loads_in_transformers(phi, tmp_path, name):
    folder, hf = phi(name)
    ids = torch.randint(3, 128, (2, 10))
    fc.hf_round_trip(folder, hf, T.AutoModelForCausalLM, tmp_path / "export", lambda m: m(input_ids=ids).logits)


def test_ours_round_trip_has_bit_equal_tensors(tmp_path):
    cfg = tfm.ModelConfig(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        max_seq_len=128,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, bias=True),
        block=BlockConfig(norm_placement="parallel_shared", mlp="gelu_tanh", d_ff=96, bias=True),
        positions=tfm.RoPE(fraction=0.5),
        tie_embeddings=False,
        final_logits_bias=True,
    )
    fc.ours_round_trip(cfg, tmp_path / "a", "phi")
    fc.ours_round_trip(cfg.replace(positions=tfm.RoPE(fraction=1.0), tie_embeddings=True), tmp_path / "b", "phi")
    written = to_hf(tfm.build_model(cfg), tmp_path / "c")  # no model_type given: the table's round trip picks phi
    assert json.loads((written / "config.json").read_text())["model_type"] == "phi"


def test_verify_passes(phi):
    fc.verify_passes(phi("phi")[0])


def test_unsupported_settings_are_named_before_any_tensor_is_read(phi, tmp_path):
    folder, _ = phi("phi")
    fc.unloadable_with(folder, tmp_path / "a", "qk_layernorm=True", qk_layernorm=True)
    fc.unloadable_with(folder, tmp_path / "b", "hidden_act='quick_gelu'", hidden_act="quick_gelu")
    with pytest.raises(ValueError, match="rope_pairing='interleaved' is not supported for phi"):
        from_hf(folder, rope_pairing="interleaved")
