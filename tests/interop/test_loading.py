"""from_hf details: interleaved RoPE load, sharded folders, config mapping, load_any and dtype."""

from __future__ import annotations

import json

import pytest
import torch

import torchformer as tfm
from torchformer.interop import config_from_hf, from_hf
from torchformer.interop.hf_llama import config_from_hf as llama_config


@pytest.mark.parametrize("name", ["llama", "llama-tied-bias-mqa", "mistral", "qwen2"])
@torch.no_grad()
def test_interleaved_load_equals_half_load(hf_model, name):
    folder, _ = hf_model(name)
    half, inter = from_hf(folder), from_hf(folder, rope_pairing="interleaved")
    assert inter.config.positions.pairing == "interleaved"
    block = "stack.blocks.0.attn.q_proj.weight"
    assert not torch.equal(half.state_dict()[block], inter.state_dict()[block])
    ids = torch.randint(0, 128, (2, 20))
    assert (half(ids) - inter(ids)).abs().max() < 1e-4  # same sums, another order


@torch.no_grad()
def test_sharded_folder_loads_like_the_single_file(hf_model, tmp_path):
    _, hf = hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    single, sharded = from_hf(hf_model("llama")[0]), from_hf(tmp_path)
    for key, tensor in single.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], tensor), key


def test_tied_head_is_one_tensor_after_loading(hf_model):
    model = from_hf(hf_model("llama-tied-bias-mqa")[0])
    assert model.lm_head.weight is model.embed.tok.weight
    bart = from_hf(hf_model("bart")[0])
    assert bart.lm_head.weight is bart.src_embed.tok.weight is bart.tgt_embed.tok.weight


def test_dtype_converts_while_reading(hf_model, tmp_path):
    model = from_hf(hf_model("llama")[0], dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    tfm.to_hf(model, tmp_path / "f64")  # writes "dtype": "float64"
    assert {p.dtype for p in from_hf(tmp_path / "f64").parameters()} == {torch.float64}
    config = json.loads((tmp_path / "f64" / "config.json").read_text())
    assert config["dtype"] == "float64"
    config["torch_dtype"] = config.pop("dtype").replace("float64", "bfloat16")  # the 4.x spelling
    (tmp_path / "f64" / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in from_hf(tmp_path / "f64", dtype="config").parameters()} == {torch.bfloat16}
    with pytest.raises(TypeError, match="dtype='fp8'"):
        from_hf(tmp_path / "f64", dtype="fp8")


def test_load_any_reads_an_hf_folder(hf_model):
    assert isinstance(tfm.load_any(hf_model("gpt2")[0]), tfm.DecoderLM)


LLAMA = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "extra, base",
    [
        ({"rope_theta": 500000.0, "torch_dtype": "bfloat16"}, 500000.0),  # transformers 4.x spelling
        ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "dtype": "float32"}, 1e6),
        ({"rope_scaling": None}, 10000.0),
    ],
)
def test_rope_theta_from_either_spelling(extra, base):
    assert llama_config({**LLAMA, **extra}).positions.base == base


def test_config_fields_mapped():
    cfg = llama_config(
        {**LLAMA, "head_dim": 32, "tie_word_embeddings": True, "eos_token_id": [7, 8], "rms_norm_eps": 1e-5}
    )
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.tie_embeddings, cfg.eos_token_id) == (32, 2, True, 7)
    assert cfg.block.norm_eps == 1e-5 and cfg.d_ff == 96
    qwen = llama_config(
        {
            **LLAMA,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 2,
        }
    )
    assert (qwen.attention.bias, qwen.attention.o_bias, qwen.attention.sliding_window) == (True, False, 16)
    # A window on some layers only is two layer kinds (issue 14 part B).
    mixed = llama_config(
        {
            **LLAMA,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    )
    assert [k.sliding_window for k in mixed.kinds] == [None, 16] and mixed.layer_kinds == ("full", "sliding")


def test_config_from_hf_reads_only_the_config(hf_model):
    assert config_from_hf(hf_model("bart")[0]).positions == tfm.Learned(offset=2)


@torch.no_grad()
def test_gpt2_body_without_transformer_prefix(hf_model, tmp_path):
    """GPT2Model checkpoints (like OpenAI's original upload) have keys h.0..., wte.weight."""
    folder, hf = hf_model("gpt2")
    hf.transformer.save_pretrained(tmp_path)
    body, full = from_hf(tmp_path), from_hf(folder)
    ids = torch.randint(0, 128, (2, 9))
    assert torch.equal(body(ids), full(ids))


@torch.no_grad()
def test_bert_task_checkpoint_with_prefix_drops_its_heads(hf_model, tmp_path):
    import transformers as T

    _, bert = hf_model("bert")
    mlm = T.BertForMaskedLM(bert.config).eval()
    mlm.save_pretrained(tmp_path)  # keys bert.embeddings..., cls.predictions...
    ids = torch.randint(0, 128, (2, 9))
    got = from_hf(tmp_path)(ids)
    assert (got - mlm.bert(input_ids=ids).last_hidden_state).abs().max() < 1e-4


@torch.no_grad()
def test_model_survives_export_over_its_own_folder(hf_model, tmp_path):
    """Weights stay memory-mapped from the file they came from; exports replace folders by rename,
    so writing over the source folder never pulls the data from under a live model."""
    import shutil

    shutil.copytree(hf_model("llama")[0], tmp_path / "m")
    model = from_hf(tmp_path / "m")
    ids = torch.randint(0, 128, (1, 8))
    before = model(ids)
    tfm.to_hf(model, tmp_path / "m")
    assert torch.equal(model(ids), before)
    assert torch.equal(from_hf(tmp_path / "m")(ids), before)
