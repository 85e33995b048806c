"""RoBERTa, XLM-RoBERTa and DistilBERT against transformers: hidden states of a right-padded
4 x 64 batch (and a left-padded one with positions given), HF round trips, round trips
from torchformer with bit-equal tensors, verify, and the settings they cannot load."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import torchformer as tfm
from torchformer.interop import config_from_hf, from_hf

from . import family_checks as fc

BERTISH = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
SPECS = {  # name -> (config, model class, task-head prefix torchformer drops)
    "roberta": lambda: (
        T.RobertaConfig(**BERTISH, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5),
        T.RobertaModel,
        "pooler.",
    ),
    "xlm-roberta": lambda: (
        T.XLMRobertaConfig(**BERTISH, max_position_embeddings=100, type_vocab_size=2, pad_token_id=1),
        T.XLMRobertaModel,
        "pooler.",
    ),
    "distilbert": lambda: (
        T.DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=128),
        T.DistilBertModel,
        "",
    ),
    "distilbert-sinusoidal": lambda: (
        T.DistilBertConfig(
            vocab_size=128,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=96,
            max_position_embeddings=96,
            sinusoidal_pos_embds=True,
            activation="relu",
        ),
        T.DistilBertModel,
        "",
    ),
}


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            config, cls, _ = SPECS[name]()
            folder = tmp_path_factory.mktemp(name)
            made[name] = folder, fc.saved(cls, config, folder)
        return made[name]

    return make


def right_padded(batch: int = 4, length: int = 64, pad: int = 1):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, n in enumerate([0, 7, 25, 50][:batch]):
        if n:
            mask[row, -n:], ids[row, -n:] = 0, pad
    return ids, mask


@pytest.mark.parametrize("name", list(SPECS))
@torch.no_grad()
def test_hidden_states_match_hf_on_a_padded_batch(enc, name):
    folder, hf = enc(name)
    ours = from_hf(folder)
    ids, mask = right_padded()
    want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours(ids, attention_mask=mask)
    assert (got - want)[mask.bool()].abs().max() < fc.TOL


@pytest.mark.parametrize("name", ["roberta", "xlm-roberta"])
@torch.no_grad()
def test_roberta_left_padding_counts_positions(enc, name):
    """HF numbers only non-pad tokens (from padding_idx + 1): encoder_positions="counted"."""
    folder, hf = enc(name)
    ours = from_hf(folder)
    assert ours.config.encoder_positions == "counted"
    ids, mask = right_padded()
    ids, mask = ids.flip(1), mask.flip(1)  # now left-padded
    want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours(ids, attention_mask=mask)
    assert (got - want)[mask.bool()].abs().max() < fc.TOL
    # By column (BERT's numbering) the same weights disagree with HF on left-padded rows.
    columns = tfm.build_model(ours.config.replace(encoder_positions="columns")).eval()
    columns.load_state_dict(ours.state_dict())
    assert (columns(ids, attention_mask=mask) - want)[mask.bool()].abs().max() > 1e-2


def test_config_translation(enc):
    roberta = config_from_hf(enc("roberta")[0])
    assert roberta.positions == tfm.Learned(offset=2) and roberta.max_seq_len == 128
    assert roberta.n_token_types == 1 and roberta.pad_token_id == 1 and roberta.block.norm_eps == 1e-5
    assert config_from_hf(enc("xlm-roberta")[0]).max_seq_len == 100 - 2
    distil = config_from_hf(enc("distilbert-sinusoidal")[0])
    assert distil.n_token_types == 0 and distil.positions == tfm.Learned() and distil.block.mlp == "relu"
    assert distil.block.norm_eps == 1e-12 and distil.block.norm_placement == "post" and distil.embed_norm


@pytest.mark.parametrize("name", list(SPECS))
def test_hf_round_trip_loads_in_transformers(enc, tmp_path, name):
    folder, hf = enc(name)
    ids, mask = right_padded(2, 12)
    run = lambda m: m(input_ids=ids, attention_mask=mask).last_hidden_state  # noqa: E731
    head = SPECS[name]()[2]
    model_type = "xlm-roberta" if name == "xlm-roberta" else None
    fc.hf_round_trip(folder, hf, T.AutoModel, tmp_path / "export", run, model_type=model_type, head=head)


def test_ours_round_trip_has_bit_equal_tensors(tmp_path):
    small = dict(vocab_size=256, d_model=64, n_layers=2, attention={"n_heads": 4}, block={"d_ff": 96}, eos_token_id=2)
    roberta = tfm.presets.get("roberta-base", **small)
    fc.ours_round_trip(roberta, tmp_path / "roberta", "roberta")
    fc.ours_round_trip(roberta.replace(n_token_types=2), tmp_path / "xlmr", "xlm-roberta")
    distil = tfm.presets.get("minilm-l6", **small, n_token_types=0, pad_token_id=0)
    fc.ours_round_trip(distil, tmp_path / "distil", "distilbert")


@pytest.mark.parametrize("name", ["roberta", "distilbert"])
def test_verify_passes(enc, name):
    fc.verify_passes(enc(name)[0])


def test_unsupported_settings_are_named_before_any_tensor_is_read(enc, tmp_path):
    for name, change, message in [
        ("roberta", dict(pad_token_id=None), "pad_token_id=None"),
        ("roberta", dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
        ("distilbert", dict(activation="quick_gelu"), "activation='quick_gelu'"),
    ]:
        fc.unloadable_with(enc(name)[0], tmp_path / f"bad-{name}", message, **change)
