"""Round trips: HF -> torchformer -> HF loads in transformers with the same tensors and logits;
torchformer preset -> HF -> torchformer is bit-equal."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import torchformer as tfm
from torchformer import Learned, RoPE, Sinusoidal
from torchformer.interop import from_hf, to_hf

from .conftest import DECODERS, SEQ2SEQS

AUTO = {"bert": T.AutoModel, **dict.fromkeys(DECODERS, T.AutoModelForCausalLM)}
AUTO.update(dict.fromkeys(SEQ2SEQS, T.AutoModelForSeq2SeqLM))


def outputs(hf, name: str) -> torch.Tensor:
    ids = torch.randint(3, 120, (2, 10))
    if name in SEQ2SEQS:
        return hf(input_ids=ids, decoder_input_ids=ids[:, :7]).logits
    return hf(input_ids=ids).logits if name != "bert" else hf(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("name", [*DECODERS, "bert", *SEQ2SEQS])
@torch.no_grad()
def test_hf_to_ours_to_hf_loads_in_transformers_unchanged(hf_model, tmp_path, name):
    folder, hf = hf_model(name)
    out = to_hf(from_hf(folder), tmp_path / "export")
    again, info = AUTO[name].from_pretrained(out, output_loading_info=True)
    again.eval()
    assert type(again) is type(hf)
    # BertModel exports carry no pooler (a task head, dropped on load): transformers creates one.
    assert [k for k in info["missing_keys"] if not k.startswith("pooler.")] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    before, after = hf.state_dict(), again.state_dict()
    # (An untied Marian export has no model.shared, which transformers 5 never reads when untied.)
    for key, tensor in after.items():
        if not key.startswith("pooler."):
            assert torch.equal(tensor, before[key]), key
    torch.manual_seed(0)
    want = outputs(hf, name)
    torch.manual_seed(0)
    assert torch.equal(outputs(again, name), want)


def randomised(cfg: tfm.ModelConfig) -> torch.nn.Module:
    """Every parameter random (norm weights and biases too), so a bit-equal check sees all of them."""
    model = tfm.build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


TINY = dict(vocab_size=256, d_model=64, n_layers=2, max_seq_len=128)
SEQ2SEQ_TINY = dict(TINY, n_decoder_layers=2, attention={"n_heads": 4}, block={"d_ff": 96, "dropout": 0.0}, dropout=0.0)
# Presets that fit a family, shrunk where the real shape is large, with the family switches flipped.
PRESETS = {
    "llama-tiny": (tfm.presets.get("llama-tiny"), "half"),
    "llama-tiny-interleaved": (tfm.presets.get("llama-tiny", positions=RoPE(pairing="interleaved")), "interleaved"),
    "llama-tiny-tied": (tfm.presets.get("llama-tiny", tie_embeddings=True), "half"),
    "qwen2-like": (tfm.presets.get("llama-tiny", attention={"bias": True, "out_bias": False}), "half"),
    "mistral-like": (tfm.presets.get("llama-tiny", attention={"sliding_window": 16}), "half"),
    "gpt2-small": (
        tfm.presets.get("gpt2-small", **TINY, attention={"n_heads": 4}, bos_token_id=0, eos_token_id=0),
        "half",
    ),
    "minilm-l6": (tfm.presets.get("minilm-l6", **TINY, attention={"n_heads": 4}, block={"d_ff": 96}), "half"),
    "marian-like": (
        tfm.presets.get("vanilla-base", **SEQ2SEQ_TINY, positions=Sinusoidal(layout="split"), final_logits_bias=True),
        "half",
    ),
    "marian-like-untied": (
        tfm.presets.get(
            "vanilla-base",
            **SEQ2SEQ_TINY,
            positions=Sinusoidal(layout="split"),
            final_logits_bias=True,
            share_embeddings=False,
            tie_embeddings=False,
        ),
        "half",
    ),
    "bart-like": (
        tfm.presets.get(
            "vanilla-base",
            **SEQ2SEQ_TINY,
            positions=Learned(offset=2),
            embed_norm=True,
            final_logits_bias=True,
            embed_scale=False,
        ),
        "half",
    ),
}


@pytest.mark.parametrize("name", list(PRESETS))
@torch.no_grad()
def test_ours_to_hf_to_ours_is_bit_equal(tmp_path, name):
    cfg, pairing = PRESETS[name]
    model = randomised(cfg)
    again = from_hf(to_hf(model, tmp_path / name), rope_pairing=pairing)
    assert type(again) is type(model)
    before, after = model.state_dict(), again.state_dict()
    assert set(before) == set(after)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    ids = torch.randint(0, 256, (2, 12))
    if cfg.arch == "encoder_decoder":
        assert torch.equal(again(ids, ids[:, :5]), model(ids, ids[:, :5]))
    else:
        assert torch.equal(again(ids), model(ids))


def test_to_hf_writes_generation_config_and_tokenizer(tmp_path):
    model = randomised(PRESETS["llama-tiny"][0])
    out = to_hf(model, tmp_path / "x", tokenizer='{"fake": true}')
    assert (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").read_text() == '{"fake": true}'
    assert T.GenerationConfig.from_pretrained(out) is not None
