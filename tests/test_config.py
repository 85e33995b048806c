"""Config validation (one test per rule, the message names the field), defaults, JSON round trip."""

import dataclasses
import json

import pytest

import torchformer as tfm
from torchformer.configs import default_d_ff

from . import grid


def model(**changes):
    base = dict(vocab_size=64, d_model=32, n_layers=2, attention=tfm.AttentionConfig(n_heads=4))
    return tfm.ModelConfig(**{**base, **changes})


# (what to build, the field the message must name, a fragment of what is allowed)
RULES = {
    "arch": (lambda: model(arch="gpt"), "arch='gpt'", "decoder"),
    "init": (lambda: model(init="kaiming"), "init='kaiming'", "xavier"),
    "vocab_size": (lambda: model(vocab_size=0), "vocab_size=0", ">= 1"),
    "d_model": (lambda: model(d_model=-8), "d_model=-8", ">= 1"),
    "n_layers": (lambda: model(n_layers=0), "n_layers=0", ">= 1"),
    "max_seq_len": (lambda: model(max_seq_len=2.5), "max_seq_len=2.5", "integer"),
    "n_decoder_layers": (lambda: model(n_decoder_layers=2), "n_decoder_layers=2", "encoder_decoder"),
    "n_decoder_layers>=1": (lambda: model(arch="encoder_decoder", n_decoder_layers=0), "n_decoder_layers=0", ">= 1"),
    "n_token_types": (lambda: model(arch="encoder", n_token_types=-1), "n_token_types=-1", ">= 0"),
    "n_token_types arch": (lambda: model(n_token_types=2), "n_token_types=2", "encoder"),
    "dropout": (lambda: model(dropout=1.0), "dropout=1.0", "[0, 1)"),
    "init_std": (lambda: model(init_std=0.0), "init_std=0.0", "> 0"),
    "attention type": (lambda: model(attention={"n_heads": 4}), "attention=", "AttentionConfig"),
    "block type": (lambda: model(block="pre"), "block='pre'", "BlockConfig"),
    "positions type": (lambda: model(positions="rope"), "positions='rope'", "None"),
    "d_model % n_heads": (lambda: model(d_model=30), "d_model=30", "divisible by attention.n_heads=4"),
    "rope even head_dim": (
        lambda: model(attention=tfm.AttentionConfig(n_heads=4, head_dim=7)),
        "attention.head_dim=7",
        "even",
    ),
    "sinusoidal even d_model": (
        lambda: model(d_model=33, attention=tfm.AttentionConfig(n_heads=3), positions=tfm.Sinusoidal()),
        "d_model=33",
        "even",
    ),
    "encoder sliding window": (
        lambda: model(arch="encoder", attention=tfm.AttentionConfig(n_heads=4, sliding_window=8)),
        "attention.sliding_window=8",
        "causal",
    ),
    "pad_token_id": (lambda: model(pad_token_id=64), "pad_token_id=64", "vocab_size=64"),
    "bos_token_id": (lambda: model(bos_token_id=-1), "bos_token_id=-1", "vocab_size=64"),
    "eos_token_id": (lambda: model(eos_token_id=99), "eos_token_id=99", "vocab_size=64"),
    "decoder_start_token_id": (lambda: model(decoder_start_token_id=64), "decoder_start_token_id=64", "[0,"),
    # nested configs check themselves on construction
    "attention.n_heads": (lambda: tfm.AttentionConfig(n_heads=0), "attention.n_heads=0", ">= 1"),
    "attention.n_kv_heads": (lambda: tfm.AttentionConfig(n_heads=4, n_kv_heads=0), "attention.n_kv_heads=0", ">= 1"),
    "attention.n_kv_heads divides": (
        lambda: tfm.AttentionConfig(n_heads=4, n_kv_heads=3),
        "attention.n_kv_heads=3",
        "divide n_heads=4",
    ),
    "attention.head_dim": (lambda: tfm.AttentionConfig(n_heads=4, head_dim=0), "attention.head_dim=0", ">= 1"),
    "attention.dropout": (lambda: tfm.AttentionConfig(n_heads=4, dropout=-0.1), "attention.dropout=-0.1", "[0, 1)"),
    "attention.backend": (lambda: tfm.AttentionConfig(n_heads=4, backend="flash"), "attention.backend='flash'", "sdpa"),
    "attention.sliding_window": (
        lambda: tfm.AttentionConfig(n_heads=4, sliding_window=0),
        "attention.sliding_window=0",
        ">= 1",
    ),
    "block.norm": (lambda: tfm.BlockConfig(norm="batchnorm"), "block.norm='batchnorm'", "rmsnorm"),
    "block.norm_placement": (lambda: tfm.BlockConfig(norm_placement="middle"), "block.norm_placement=", "post"),
    "block.mlp": (lambda: tfm.BlockConfig(mlp="tanh"), "block.mlp='tanh'", "swiglu"),
    "block.norm_eps": (lambda: tfm.BlockConfig(norm_eps=0.0), "block.norm_eps=0.0", "> 0"),
    "block.d_ff": (lambda: tfm.BlockConfig(d_ff=0), "block.d_ff=0", ">= 1"),
    "block.dropout": (lambda: tfm.BlockConfig(dropout=1.5), "block.dropout=1.5", "[0, 1)"),
    "positions.layout": (lambda: tfm.Sinusoidal(layout="concat"), "positions.layout='concat'", "split"),
    "sinusoidal base": (lambda: tfm.Sinusoidal(base=1.0), "positions.base=1.0", "> 1"),
    "positions.offset": (lambda: tfm.Learned(offset=-2), "positions.offset=-2", ">= 0"),
    "positions.pairing": (lambda: tfm.RoPE(pairing="gptj"), "positions.pairing='gptj'", "interleaved"),
    "rope base": (lambda: tfm.RoPE(base=0.5), "positions.base=0.5", "> 1"),
    "positions.num_buckets": (lambda: tfm.RelativeBias(num_buckets=2), "positions.num_buckets=2", ">= 4"),
    "positions.max_distance": (
        lambda: tfm.RelativeBias(num_buckets=32, max_distance=16),
        "positions.max_distance=16",
        "num_buckets // 2 = 16",
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_names_field_value_and_allowed(rule):
    make, named, allowed = RULES[rule]
    with pytest.raises(ValueError) as err:
        make()
    assert named in str(err.value)
    assert allowed in str(err.value)


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as err:
        model(vocab_size=0, d_model=30, dropout=2.0, block=tfm.BlockConfig(), eos_token_id=5)
    msg = str(err.value)
    for fragment in ("vocab_size=0", "d_model=30", "dropout=2.0"):
        assert fragment in msg
    with pytest.raises(ValueError) as err:
        tfm.BlockConfig(norm="x", mlp="y", norm_eps=-1.0)
    assert all(f in str(err.value) for f in ("block.norm='x'", "block.mlp='y'", "block.norm_eps=-1.0"))


def test_configs_are_frozen():
    cfg = model()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 64


def test_replace_with_nested_dicts_revalidates():
    cfg = model().replace(attention={"n_kv_heads": 2}, block={"mlp": "swiglu"}, d_model=64)
    assert (cfg.n_kv_heads, cfg.attention.n_heads, cfg.block.mlp, cfg.d_model) == (2, 4, "swiglu", 64)
    with pytest.raises(ValueError, match="attention.n_kv_heads=3"):
        model().replace(attention={"n_kv_heads": 3})


@pytest.mark.parametrize(
    ("d_model", "mlp", "expected"),
    [
        (4096, "swiglu", 11008),
        (4096, "geglu", 11008),
        (768, "gelu", 3072),
        (512, "relu", 2048),
        (128, "swiglu", 512),
        (384, "swiglu", 1024),
    ],
)
def test_default_d_ff(d_model, mlp, expected):
    # 8/3 * 4096 = 10922.7 -> next multiple of 256 is 11008 (Llama 2 7B); 8/3 * 384 = 1024 exactly.
    assert default_d_ff(d_model, mlp) == expected
    cfg = model(d_model=d_model, block=tfm.BlockConfig(mlp=mlp))
    assert cfg.d_ff == expected
    assert model(d_model=d_model, block=tfm.BlockConfig(mlp=mlp, d_ff=100)).d_ff == 100


def test_derived_values():
    cfg = model(attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=16))
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.decoder_layers) == (16, 1, 2)
    assert model().head_dim == 8
    assert model(arch="encoder_decoder", n_decoder_layers=3).decoder_layers == 3
    assert model(block=tfm.BlockConfig(norm_placement="post")).has_final_norm is False
    assert model(block=tfm.BlockConfig(norm_placement="pre")).has_final_norm is True


def _all_configs():
    return [tfm.presets.get(n) for n in tfm.presets.names()] + [grid.config(v) for v in grid.variants()]


def test_json_round_trip_for_every_preset_and_grid_row():
    for cfg in _all_configs():
        text = json.dumps(cfg.to_dict())
        back = tfm.ModelConfig.from_dict(json.loads(text))
        assert back == cfg
        assert type(back.positions) is type(cfg.positions)


def test_json_positions_carry_a_kind_tag():
    d = model(positions=tfm.RoPE(pairing="interleaved", base=500000.0)).to_dict()
    assert d["positions"] == {
        "kind": "rope",
        "base": 500000.0,
        "pairing": "interleaved",
        "fraction": 1.0,
        "scaling": None,
    }
    assert model(positions=None).to_dict()["positions"] is None
    assert tfm.ModelConfig.from_dict(model(positions=None).to_dict()).positions is None


@pytest.mark.parametrize(
    ("where", "edit"),
    [
        ("ModelConfig", lambda d: d.update(n_layer=2)),
        ("attention", lambda d: d["attention"].update(num_heads=4)),
        ("block", lambda d: d["block"].update(activation="gelu")),
        ("positions", lambda d: d["positions"].update(theta=1e4)),
    ],
)
def test_unknown_keys_are_rejected(where, edit):
    d = model().to_dict()
    edit(d)
    with pytest.raises(ValueError, match=f"unknown key.*in {where}"):
        tfm.ModelConfig.from_dict(d)


def test_unknown_position_kind_is_rejected():
    d = model().to_dict()
    d["positions"]["kind"] = "xpos"
    with pytest.raises(ValueError, match="positions.kind='xpos'"):
        tfm.ModelConfig.from_dict(d)


def test_invalid_values_in_json_are_validated():
    d = model().to_dict()
    d["attention"]["n_kv_heads"] = 3
    with pytest.raises(ValueError, match="attention.n_kv_heads=3"):
        tfm.ModelConfig.from_dict(d)


TYPE_RULES = {
    "attention.n_heads": (lambda: tfm.AttentionConfig(n_heads="4"), "attention.n_heads='4'", "an integer"),
    "attention.bias": (lambda: tfm.AttentionConfig(n_heads=4, bias=1), "attention.bias=1", "true or false"),
    "block.d_ff": (lambda: tfm.BlockConfig(d_ff=3.0), "block.d_ff=3.0", "an integer or None"),
    "block.dropout": (lambda: tfm.BlockConfig(dropout="0.1"), "block.dropout='0.1'", "a number"),
    "positions.base": (lambda: tfm.RoPE(base="1e4"), "positions.base='1e4'", "a number"),
    "positions.num_buckets": (lambda: tfm.RelativeBias(num_buckets=None), "positions.num_buckets=None", "integer"),
    "d_model": (lambda: model(d_model=32.0), "d_model=32.0", "an integer"),
    "n_layers bool": (lambda: model(n_layers=True), "n_layers=True", "an integer"),
    "tie_embeddings": (lambda: model(tie_embeddings="yes"), "tie_embeddings='yes'", "true or false"),
    "eos_token_id": (lambda: model(eos_token_id="1"), "eos_token_id='1'", "an integer or None"),
}


@pytest.mark.parametrize("rule", list(TYPE_RULES))
def test_wrong_scalar_types_name_the_field(rule):
    """A string or float where an int belongs (e.g. from YAML) is a ValueError naming the field,
    never a TypeError from deep inside a comparison or nn.Linear."""
    make, named, allowed = TYPE_RULES[rule]
    with pytest.raises(ValueError) as err:
        make()
    assert named in str(err.value) and allowed in str(err.value)


def test_ints_are_accepted_for_float_fields():
    assert tfm.RoPE(base=10000).base == 10000
    assert model(dropout=0, init_std=1).dropout == 0
