"""T5 against transformers: v1.0 (ReLU, tied head, decoder output times d_model ** -0.5) and
Flan / v1.1 (gated gelu_new, an untied lm_head as the published checkpoints store it, d_kv * heads
!= d_model), few relative-bias buckets so 64-token sequences reach the log-spaced ones."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import torchformer as tfm
from torchformer.interop import config_from_hf, from_hf

from . import family_checks as fc

BASE = dict(
    vocab_size=128,
    d_model=64,
    d_ff=96,
    num_layers=3,
    num_decoder_layers=2,  # fewer than the encoder's (HF generate sizes its cache by num_layers)
    num_heads=4,
    relative_attention_num_buckets=16,
    relative_attention_max_distance=24,
    initializer_factor=1.0,
    decoder_start_token_id=0,  # as the published config.json files say
)
SPECS = {
    "t5-v1.0": dict(d_kv=16, feed_forward_proj="relu"),
    "flan-t5": dict(d_kv=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def untied_like_flan(folder, seed: int = 5) -> None:
    """Rewrite a saved tiny v1.1 model as the Flan-T5 uploads are: tie_word_embeddings False, no
    scale_decoder_outputs key, and an lm_head.weight of its own."""
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    tensors["lm_head.weight"] = torch.randn(tensors["shared.weight"].shape, generator=gen)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    hf.pop("scale_decoder_outputs")
    (folder / "config.json").write_text(json.dumps(dict(hf, tie_word_embeddings=False)))


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            fc.saved(T.T5ForConditionalGeneration, T.T5Config(**BASE, **SPECS[name]), folder)
            if name == "flan-t5":
                untied_like_flan(folder)
            made[name] = folder, T.T5ForConditionalGeneration.from_pretrained(folder).eval()
        return made[name]

    return make


def padded_source(batch: int = 4, length: int = 64, pads: tuple[int, ...] = (0, 5, 20, 41)):
    src = torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(src)
    for row, n in enumerate(pads):  # right padding, as T5 tokenizers pad
        if n:
            mask[row, -n:] = 0
            src[row, -n:] = 0
    return src, mask


@pytest.mark.parametrize("name", list(SPECS))
@torch.no_grad()
def test_logits_match_hf_on_a_padded_batch(t5, name):
    folder, hf = t5(name)
    ours = from_hf(folder)
    src, mask = padded_source()
    tgt = torch.randint(2, 128, (4, 64), generator=torch.Generator().manual_seed(8))
    want = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert (ours(src, tgt, src_mask=mask) - want).abs().max() < fc.TOL
    memory = ours.encode(src, src_mask=mask)
    hf_memory = hf.encoder(input_ids=src, attention_mask=mask).last_hidden_state
    assert (memory - hf_memory)[mask.bool()].abs().max() < fc.TOL


def test_config_translation(t5):
    v10, flan = (config_from_hf(t5(name)[0]) for name in SPECS)
    assert v10.block.mlp == "relu" and v10.tie_embeddings and v10.head_scale == 64**-0.5
    assert flan.block.mlp == "geglu_tanh" and not flan.tie_embeddings and flan.head_scale is None
    for cfg in (v10, flan):
        assert cfg.attention.scale == 1.0 and cfg.block.norm == "rmsnorm" and not cfg.block.bias
        assert cfg.decoder_start_token_id == 0 and cfg.eos_token_id == 1
        assert (cfg.n_layers, cfg.decoder_layers) == (3, 2)
    assert flan.head_dim * flan.attention.n_heads == 32 != flan.d_model


@pytest.mark.parametrize("name", list(SPECS))
@torch.no_grad()
def test_greedy_16_tokens_match_generate(t5, name):
    folder, hf = t5(name)
    ours = from_hf(folder)
    src, mask = padded_source(3, 14, (0, 4, 9))
    want = hf.generate(src, attention_mask=mask, max_new_tokens=16, do_sample=False, num_beams=1)
    got = tfm.generate(ours, src, attention_mask=mask, max_new_tokens=16)
    for row_got, row_want in zip(got.tolist(), want.tolist()):
        assert row_got[0] == row_want[0] == 0  # decoder_start_token_id: T5's pad
        row_want = fc.until_eos(row_want[1:], 1)
        assert len(row_want) >= 4
        assert row_got[1 : 1 + len(row_want)] == row_want


@pytest.mark.parametrize("name", list(SPECS))
def test_hf_round_trip_loads_in_transformers(t5, tmp_path, name):
    folder, hf = t5(name)
    src = torch.randint(2, 128, (2, 10))
    run = lambda m: m(input_ids=src, decoder_input_ids=src[:, :7]).logits  # noqa: E731
    fc.hf_round_trip(folder, hf, T.AutoModelForSeq2SeqLM, tmp_path / "export", run)


def test_ours_round_trip_has_bit_equal_tensors(tmp_path):
    small = dict(vocab_size=256, d_model=64, n_layers=2, n_decoder_layers=2, attention={"n_heads": 4, "head_dim": 8})
    v10 = tfm.presets.get("t5-small", **small, block={"d_ff": 96}, head_scale=64**-0.5)  # the scale follows d_model
    fc.ours_round_trip(v10, tmp_path / "a", "t5")
    fc.ours_round_trip(tfm.presets.get("flan-t5-base", **small, block={"d_ff": 96}), tmp_path / "b", "t5")


def test_verify_passes(t5):
    fc.verify_passes(t5("flan-t5")[0])


def test_unsupported_settings_are_named_before_any_tensor_is_read(t5, tmp_path):
    folder, _ = t5("t5-v1.0")
    fc.unloadable_with(folder, tmp_path / "bad", "feed_forward_proj='gated-relu'", feed_forward_proj="gated-relu")
