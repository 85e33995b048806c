"""Issue 14 part B families against transformers: Qwen3 (per-head QK-norm, per-layer windows),
SmolLM3 (NoPE layers), OLMo 2 (output norms, QK-norm over the width), Gemma (1 + w norms, scaled
embeddings), Gemma 2 (sandwich norms, soft-caps, alternating windows, query_pre_attn_scalar),
Gemma 3 (5 local : 1 global with a RoPE per kind, QK-norm) and Qwen2 with windows on its upper
layers only. Tiny random models built offline from config objects, with settings that bite:
GQA, windows of 8-16 keys on 64-token rows, explicit head_dim != d_model / n_heads, soft-caps
below the raw scores, RoPE bases far apart."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from torchformer.interop import config_from_hf, from_hf

from . import family_checks as fc

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, attn_implementation="eager",
)  # fmt: skip
ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
SPECS = {
    "qwen3": lambda: (
        T.Qwen3Config(
            **BASE,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=3,
            rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
        ),  # fmt: skip
        T.Qwen3ForCausalLM,
    ),
    "qwen3-tied-bias": lambda: (
        T.Qwen3Config(
            **BASE, attention_bias=True, tie_word_embeddings=True, initializer_range=0.3, rope_parameters=ROPE
        ),  # fmt: skip
        T.Qwen3ForCausalLM,
    ),
    "smollm3": lambda: (
        T.SmolLM3Config(
            **{**BASE, "pad_token_id": 0}, no_rope_layer_interval=3, rope_parameters=ROPE, initializer_range=0.15
        ),  # fmt: skip
        T.SmolLM3ForCausalLM,
    ),
    "olmo2": lambda: (T.Olmo2Config(**BASE, rope_parameters=ROPE, initializer_range=0.1), T.Olmo2ForCausalLM),
    # Without EMBED_SCALE the Gemma rows repeat one token under greedy decoding (gemma at 0.1: 1-2 distinct).
    "gemma": lambda: (T.GemmaConfig(**BASE, rope_parameters=ROPE, initializer_range=0.3), T.GemmaForCausalLM),
    "gemma2": lambda: (
        T.Gemma2Config(
            **BASE,
            sliding_window=10,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=2.0,
            query_pre_attn_scalar=32,
            rope_parameters=ROPE,
            initializer_range=0.3,
        ),  # fmt: skip
        T.Gemma2ForCausalLM,
    ),
    "gemma3_text": lambda: (
        T.Gemma3TextConfig(
            **BASE,
            sliding_window=8,
            query_pre_attn_scalar=16,
            initializer_range=0.3,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),  # fmt: skip
        T.Gemma3ForCausalLM,
    ),
    "qwen2-upper-windows": lambda: (
        T.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=9, max_window_layers=4, rope_parameters=ROPE,
                      initializer_range=0.2),  # fmt: skip
        T.Qwen2ForCausalLM,
    ),
}
NAMES = sorted(SPECS)
# fc.saved: so the blocks, not the embedding, decide the argmax.
EMBED_SCALE = {"gemma": 0.1, "gemma2": 0.3, "gemma3_text": 0.1}
# The torchformer feature each spec must come through as (so a silent fallback fails here).
EXPECT = {
    "qwen3": lambda c: c.attention.qk_norm == "head" and c.layer_kinds is not None,
    "qwen3-tied-bias": lambda c: c.attention.qk_norm == "head" and c.attention.bias and c.tie_embeddings,
    "smollm3": lambda c: sum(k.rope is None for k in c.kinds) == 1 and c.layer_kinds.count(c.layer_kinds[2]) == 2,
    "olmo2": lambda c: c.block.norm_placement == "output" and c.attention.qk_norm == "width",
    "gemma": lambda c: c.block.norm == "rmsnorm_1p" and c.embed_scale_in_dtype and c.block.mlp == "geglu_tanh",
    "gemma2": lambda c: c.block.norm_placement == "sandwich" and c.final_softcap == 2.0 and len(c.kinds) == 2,
    "gemma3_text": lambda c: len({k.rope for k in c.kinds}) == 2 and c.attention.qk_norm == "head",
    "qwen2-upper-windows": lambda c: [k.sliding_window for k in c.kinds] == [None, 9],
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made: dict[str, tuple] = {}

    def make(name: str):
        if name not in made:
            config, cls = SPECS[name]()
            folder = tmp_path_factory.mktemp(name)
            made[name] = (folder, fc.saved(cls, config, folder, embed_scale=EMBED_SCALE.get(name, 1.0)))
        return made[name]

    return make


@pytest.mark.parametrize("name", NAMES)
def test_config_translation_keeps_the_quirk(family, name):
    folder, _ = family(name)
    assert EXPECT[name](config_from_hf(folder))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_on_a_padded_4x64_batch(family, name):
    folder, hf = family(name)
    diff = fc.decoder_max_diff(folder, hf, 128)
    assert diff < fc.TOL, diff


@pytest.mark.parametrize("name", NAMES)
def test_greedy_16_varied_tokens_match_generate(family, name):
    folder, hf = family(name)
    fc.decoder_greedy_equal(folder, hf, 128)


@pytest.mark.parametrize("name", NAMES)
def test_hf_to_ours_to_hf_loads_with_no_missing_keys_and_equal_outputs(family, name, tmp_path):
    folder, hf = family(name)
    ids = torch.randint(3, 128, (2, 40))

    def run(model):  # the reloaded model would pick sdpa; both sides run the same kernels
        model.set_attn_implementation("eager")
        return model(input_ids=ids).logits

    fc.hf_round_trip(folder, hf, T.AutoModelForCausalLM, tmp_path / "export", run)


@pytest.mark.parametrize("name", NAMES)
def test_ours_to_hf_to_ours_has_bit_equal_tensors(family, name, tmp_path):
    folder, _ = family(name)
    cfg = config_from_hf(folder)
    fc.ours_round_trip(cfg, tmp_path / "export", None)


@pytest.mark.parametrize("name", NAMES)
def test_verify_passes(family, name):
    fc.verify_passes(family(name)[0])


@torch.no_grad()
def test_the_quirks_bite(family):
    """Each quirk changes the logits: the same weights without it are far from transformers."""
    folder, hf = family("gemma2")
    ids = torch.randint(3, 128, (1, 64))
    want = hf(input_ids=ids).logits
    ours = from_hf(folder)
    assert (ours(ids) - want).abs().max() < fc.TOL
    ours.lm_head.softcap = None  # the final soft-cap of 2 is below the raw logits
    assert (ours(ids) - want).abs().max() > 0.1


BAD_CONFIGS = {  # name -> (config.json changes, the words the error must contain)
    "gemma3_text": ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    "qwen3": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "smollm3": ({"no_rope_layers": [1, 0]}, "no_rope_layers=[1, 0]: must have num_hidden_layers=6 entries"),
    "gemma2": ({"layer_types": ["chunked_attention"] * 6}, "layer_types=['chunked_attention'"),
    "qwen2-upper-windows": ({"layer_types": ["sliding_attention"] * 2}, "must be 6 entries of"),
    "gemma": ({"hidden_act": "relu"}, "hidden_act='relu': supported are"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_unsupported_checkpoint_settings_fail_before_any_tensor_is_read(family, name, tmp_path):
    import json
    import shutil

    folder, _ = family(name)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    config = json.loads((bad / "config.json").read_text())
    changes, words = BAD_CONFIGS[name]
    (bad / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError) as err:
        from_hf(bad)
    assert words in str(err.value), str(err.value)


def test_layer_kinds_the_format_cannot_say_are_refused(tmp_path):
    import torchformer as tfm
    from torchformer.configs import LayerKind
    from torchformer.interop import to_hf

    cfg = config_from_hf(family_config("qwen3", tmp_path / "cfg")).replace(
        layer_kinds=("a", "a", "b", "b", "c", "c"),
        kinds={"a": LayerKind(sliding_window=3), "b": LayerKind(sliding_window=5), "c": LayerKind(sliding_window=None)},
    )
    with pytest.raises(ValueError, match=r"sliding windows \[3, 5\]: config.json has one sliding_window"):
        to_hf(tfm.build_model(cfg), tmp_path / "x", model_type="qwen3")
    nope = cfg.replace(layer_kinds=("a",) * 5 + ("b",), kinds={"a": LayerKind(), "b": LayerKind(rope=None)})
    with pytest.raises(ValueError, match="qwen3 has no NoPE layers"):
        to_hf(tfm.build_model(nope), tmp_path / "y", model_type="qwen3")
    with pytest.raises(ValueError, match="a layer kind with its own RoPE or NoPE"):
        to_hf(tfm.build_model(nope.replace(attention={"qk_norm": None})), tmp_path / "z", model_type="llama")


def family_config(name: str, folder):
    """``folder`` holding only the config.json of spec ``name`` (no weights needed)."""
    config, _ = SPECS[name]()
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", NAMES)
def test_cli_generate_and_plan_on_the_hf_folder(family, name, capsys):
    import torchformer as tfm
    from torchformer.cli.main import main

    folder, _ = family(name)
    assert main(["generate", str(folder), "--ids", "5,6,7", "--max-new-tokens", "6"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    assert printed == tfm.generate(from_hf(folder), torch.tensor([[5, 6, 7]]), max_new_tokens=6)[0].tolist()
    assert main(["plan", str(folder)]) == 0
    assert str(tfm.count_params(config_from_hf(folder))) in capsys.readouterr().out.replace(",", "")
