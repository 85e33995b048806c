"""Phi-3 against transformers: GQA with a sliding window shorter than the batch, and longrope
(factor lists != 1, the 64-token batch past the original context so the long factors are used)
with partial rotary; fused qkv_proj / gate_up_proj split and fused by the key map."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import torchformer as tfm
from torchformer.configs import LongRoPE
from torchformer.interop import config_from_hf

from . import family_checks as fc

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.2,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,  # 8 of 16 features rotate: 4 factors per list
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [2.0, 4.0, 6.0, 12.0],
    "original_max_position_embeddings": 32,
}
SPECS = {
    "phi3-window": dict(max_position_embeddings=128, sliding_window=24),
    "phi3-longrope-partial": dict(
        max_position_embeddings=256, original_max_position_embeddings=32, rope_parameters=LONGROPE
    ),
}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = folder, fc.saved(T.Phi3ForCausalLM, T.Phi3Config(**BASE, **SPECS[name]), folder)
        return made[name]

    return make


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_hf_on_a_padded_batch(phi3, name):
    folder, hf = phi3(name)
    assert fc.decoder_max_diff(folder, hf, 128) < fc.TOL


def test_config_translation(phi3):
    cfg = config_from_hf(phi3("phi3-longrope-partial")[0])
    assert isinstance(cfg.positions.scaling, LongRoPE) and cfg.positions.fraction == 0.5
    assert cfg.positions.scaling.long_factor == tuple(LONGROPE["long_factor"])
    assert cfg.positions.scaling.original_max_seq_len == 32 and cfg.max_seq_len == 256
    assert config_from_hf(phi3("phi3-window")[0]).attention.sliding_window == 24


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_16_tokens_match_generate(phi3, name):
    folder, hf = phi3(name)  # 6 + 16 tokens stay below the original 32: the short factors
    fc.decoder_greedy_equal(folder, hf, 128)


@pytest.mark.parametrize("name", list(SPECS))
def test_hf_round_trip_loads_in_transformers(phi3, tmp_path, name):
    folder, hf = phi3(name)
    ids = torch.randint(3, 128, (2, 40))
    run = lambda m: m(input_ids=ids).logits  # noqa: E731
    fc.hf_round_trip(folder, hf, T.AutoModelForCausalLM, tmp_path / "export", run, model_type="phi3")


def test_ours_round_trip_has_bit_equal_tensors(tmp_path):
    small = dict(vocab_size=256, d_model=64, n_layers=2, attention={"n_heads": 4, "n_kv_heads": 2}, block={"d_ff": 96})
    small.update(pad_token_id=0, eos_token_id=2)
    fc.ours_round_trip(tfm.presets.get("phi3-mini", **small), tmp_path / "a", "phi3")
    scaled = tfm.RoPE(fraction=0.5, scaling=LongRoPE(**{k: LONGROPE[k] for k in ("short_factor", "long_factor")},
                                                      original_max_seq_len=32))  # fmt: skip
    cfg = tfm.presets.get("phi3-mini", **small, positions=scaled, max_seq_len=256)
    fc.ours_round_trip(cfg.replace(attention={"sliding_window": None}), tmp_path / "b", "phi3")


def test_verify_passes(phi3):
    fc.verify_passes(phi3("phi3-window")[0])


def test_unsupported_settings_are_named_before_any_tensor_is_read(phi3, tmp_path):
    folder, _ = phi3("phi3-window")
    fc.unloadable_with(folder, tmp_path / "a", "hidden_act='gelu'", hidden_act="gelu")
    linear = {"rope_type": "linear", "factor": 2.0}
    fc.unloadable_with(folder, tmp_path / "b", "Phi-3 has 'default' or 'longrope'", rope_parameters=linear)
