"""`--dtype` (issue 25): a bf16 Hugging Face folder loads and generates in bf16 (parameters and KV
cache; position tables stay float32), --dtype float32 upcasts it, --dtype bfloat16 on an fp32
checkpoint gives the tokens of a bf16 copy saved by hand, float16 runs on the CPU (or says it
cannot, before loading), the cast comes before --quantize, and a typo names the argument."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.loading import load_any, stored_dtype

IDS = [3, 9, 4, 3, 9, 4, 3]
NEW = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """bf16/: a Llama saved by transformers in bf16; fp32/: a torchformer checkpoint in float32;
    fp32-as-bf16/: the same checkpoint cast with .to(bfloat16) and saved, the hand-made reference."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("dtype")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "bf16")
    cfg = tfm.presets.get("llama-tiny", vocab_size=61, n_layers=2, max_seq_len=64, tie_embeddings=True)
    model = tfm.build_model(cfg)
    tfm.save(model, root / "fp32")
    tfm.save(tfm.load(root / "fp32").to(torch.bfloat16), root / "fp32-as-bf16")
    return root


def printed(capsys, argv) -> list[int]:
    assert main(argv) == 0
    return [int(t) for t in capsys.readouterr().out.strip().split(",")]


def generate_cli(capsys, folder, *extra) -> list[int]:
    ids = ",".join(map(str, IDS))
    return printed(capsys, ["generate", str(folder), "--ids", ids, "--max-new-tokens", str(NEW), *extra])


def library(model) -> list[int]:
    return tfm.generate(model, torch.tensor([IDS]), max_new_tokens=NEW)[0].tolist()


def dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_a_bf16_folder_loads_and_generates_in_bf16(folders, capsys):
    assert stored_dtype(folders / "bf16") == torch.bfloat16
    model = load_any(folders / "bf16")
    assert dtypes(model) == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float64}  # RoPE frequencies: not rounded to bf16
    cache = model.new_cache(1, 16)
    assert {t.dtype for layer in cache.layers for t in (layer.k, layer.v)} == {torch.bfloat16}
    assert generate_cli(capsys, folders / "bf16") == library(model)


def test_dtype_float32_upcasts_a_bf16_folder(folders, capsys):
    model = load_any(folders / "bf16", dtype="float32")
    assert dtypes(model) == {torch.float32}
    assert model.new_cache(1, 4).layers[0].k.dtype == torch.float32
    assert generate_cli(capsys, folders / "bf16", "--dtype", "float32") == library(model)


def test_dtype_bfloat16_on_an_fp32_checkpoint_matches_a_bf16_copy_made_by_hand(folders, capsys):
    by_hand = tfm.load(folders / "fp32-as-bf16")
    assert dtypes(by_hand) == {torch.bfloat16}
    cast = load_any(folders / "fp32", dtype=torch.bfloat16)
    assert dtypes(cast) == {torch.bfloat16} and cast.lm_head.weight is cast.embed.tok.weight  # still tied
    assert generate_cli(capsys, folders / "fp32", "--dtype", "bfloat16") == library(by_hand)
    assert generate_cli(capsys, folders / "fp32") == library(tfm.load(folders / "fp32"))  # default: as stored


def test_float16_runs_on_the_cpu(folders, capsys):
    model = load_any(folders / "fp32", dtype="float16")
    assert dtypes(model) == {torch.float16} and model.new_cache(1, 4).layers[0].k.dtype == torch.float16
    assert generate_cli(capsys, folders / "fp32", "--dtype", "float16") == library(model)


def test_a_dtype_this_torch_cannot_run_is_refused_before_loading(folders, capsys, monkeypatch):
    import torchformer.cli.generate as generate_module

    real = torch.nn.functional.scaled_dot_product_attention

    def no_half(q, *args, **kwargs):
        if q.dtype == torch.float16:
            raise RuntimeError("\"scaled_dot_product_attention\" not implemented for 'Half'")
        return real(q, *args, **kwargs)

    def must_not_load(*args, **kwargs):
        raise AssertionError("the weights were read before --dtype was checked")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_half)
    monkeypatch.setattr(generate_module, "load_any", must_not_load)
    assert main(["generate", str(folders / "fp32"), "--ids", "1,2", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dtype float16" in err and "'bfloat16', 'float32'" in err, err


@pytest.mark.parametrize(("scheme", "extra"), [("int8", []), ("int4", ["--group-size", "32"])])
def test_dtype_flows_into_quantized_linears(folders, capsys, scheme, extra):
    """Cast first, then quantize: the integer linears take bf16 activations (quant.py's fast bf16
    int8 product) and the logits stay bf16."""
    model = tfm.quantize(tfm.load(folders / "fp32-as-bf16"), scheme, group_size=32 if scheme == "int4" else None)
    assert model(torch.tensor([IDS])).dtype == torch.bfloat16
    got = generate_cli(capsys, folders / "fp32", "--dtype", "bfloat16", "--quantize", scheme, *extra)
    assert got == library(model)


def test_a_dtype_typo_names_the_argument_and_the_choices(folders, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(folders / "fp32"), "--ids", "1,2", "--dtype", "bf16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "'bf16'" in err and "bfloat16" in err and "float32" in err, err


def test_serve_casts_before_it_quantizes(folders):
    """`torchformer serve --dtype bfloat16 --quantize int8` loads what `generate` runs."""
    from torchformer.cli.serve import loader

    model = loader(str(folders / "fp32"), "int8", 0, torch.bfloat16)()
    assert model.embed.tok.weight.dtype == torch.bfloat16 and model(torch.tensor([IDS])).dtype == torch.bfloat16
    assert library(model) == library(tfm.quantize(tfm.load(folders / "fp32-as-bf16"), "int8"))
