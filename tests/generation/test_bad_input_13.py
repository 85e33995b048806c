"""Issue 13's bad input not covered beside its feature (quantize's scheme / group size / twice:
tests/nn/test_quant.py; draft vocabulary, encoder-decoder target, num_draft_tokens < 1:
tests/generation/test_speculative.py): HF export of a quantized model, training a quantized model
(the CLI flag and a quantized model.init without LoRA), and the remaining speculative arguments.
Each is one clear error naming the argument and its value, raised before anything is written or
changed; the quantized model.init that is allowed (LoRA, with a safe config change) loads the
same model as tfm.load."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm
from tests.grid import build, variants
from tests.training.tiny import tiny_recipe, words_text
from torchformer.cli.main import main
from torchformer.interop import to_hf
from torchformer.nn.quant import QuantLinear
from torchformer.training import finetune
from torchformer.training import recipe as recipes
from torchformer.training.train import train

SCHEMES = [("int8", None), ("int4", 16)]


def tiny_decoder():
    torch.manual_seed(0)
    return tfm.build_model(tfm.presets.get("llama-tiny", vocab_size=61, n_layers=2, max_seq_len=32)).eval()


def state_copy(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_to_hf_of_a_quantized_model_names_the_scheme_and_writes_nothing(tmp_path, scheme, group):
    model = tfm.quantize(tiny_decoder(), scheme, group_size=group)
    before = state_copy(model)
    with pytest.raises(ValueError, match=rf"model is quantized \(scheme='{scheme}', group_size={group}\): "
                       r"Hugging Face export needs the unquantized weights"):  # fmt: skip
        to_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
    # The float model it came from exports (the advice in the message works).
    assert (to_hf(tiny_decoder(), tmp_path / "float") / "model.safetensors").is_file()


def test_to_hf_refuses_quantized_linears_without_the_record():
    model = tfm.quantize(tiny_decoder(), "int8")
    del model.quantization  # e.g. modules swapped by hand: the modules themselves decide
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match=r"model is quantized \(its linears are quantized\)"):
        to_hf(model, "unused")


@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_convert_to_hf_of_a_quantized_checkpoint_is_one_line(tmp_path, capsys, scheme, group):
    tfm.save(tfm.quantize(tiny_decoder(), scheme, group_size=group), tmp_path / "q")
    assert main(["convert", "--to-hf", str(tmp_path / "q"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchformer convert: error: model is quantized (scheme='{scheme}'")
    assert "needs the unquantized weights" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def test_train_cli_quantize_flag_explains(tmp_path, capsys):
    assert main(["train", "--quantize", "int8", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "--quantize int8: weight-only quantized weights cannot be trained" in err
    assert "finetune.lora" in err and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def quantized_init(tmp_path_factory):
    """A trained tiny char model (2 steps) saved int8 with its tokenizer: a model.init."""
    root = tmp_path_factory.mktemp("qinit")
    (root / "c.txt").write_text(words_text(120))
    torch.set_num_threads(1)
    train(tiny_recipe(root / "base", root / "c.txt", train={"steps": 2, "eval_every": 2}))
    q = tfm.quantize(tfm.load(root / "base"), "int8")
    tfm.save(q, root / "q", extra_files={"tokenizer.json": (root / "base" / "tokenizer.json").read_text()})
    return root


def finetune_recipe(root, out, *, lora=None, model=None):
    raw = tiny_recipe(root / out, root / "c.txt", train={"steps": 2, "eval_every": 2}).to_dict()
    raw["model"] = {"init": str(root / "q"), **(model or {})}
    raw["finetune"] = {"lora": lora}
    return recipes.from_dict(raw)


def test_full_training_of_a_quantized_init_is_refused_before_anything_is_written(quantized_init):
    root = quantized_init
    with pytest.raises(ValueError, match=rf"model.init='{root / 'q'}' is weight-only quantized \(scheme='int8'\)"
                       r".*add finetune.lora"):  # fmt: skip
        train(finetune_recipe(root, "out"))
    assert not (root / "out").exists()


def test_lora_over_a_quantized_init_with_a_safe_change_loads_the_same_model(quantized_init):
    """A safe change (dropout) rebuilds the model: it gets the same integer modules, so the
    quantized state fits and the logits equal tfm.load's (it was a KeyError before)."""
    root = quantized_init
    lora = {"rank": 2, "targets": ["q_proj"]}
    r = finetune_recipe(root, "out", lora=lora, model={"dropout": 0.1})
    finetune.check(r)  # allowed
    model = finetune.load_init(r, torch.device("cpu"), 1).eval()
    ref = tfm.load(root / "q")
    assert model.config.dropout == 0.1 and model.quantization == ref.quantization
    ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), ref(ids))


def test_speculative_arguments_left(tmp_path):
    v = variants(("decoder",))[0]
    model = build(v)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"num_draft_tokens=2 sizes a draft model's guesses.*"
                       r"prompt_lookup_num_tokens=3"):  # fmt: skip
        tfm.generate(model, ids, max_new_tokens=4, prompt_lookup_num_tokens=3, num_draft_tokens=2)
    with torch.device("meta"):
        elsewhere = build(v)
    with pytest.raises(ValueError, match=r"draft_model is on meta but input_ids \(and the target\) are on cpu"):
        tfm.generate(model, ids, max_new_tokens=4, draft_model=elsewhere)
    s2s = build(variants(("encoder_decoder",))[0])
    with pytest.raises(TypeError, match=r"draft_model must be a DecoderLM, got EncoderDecoder"):
        tfm.generate(model, ids, max_new_tokens=4, draft_model=s2s)
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"num_draft_tokens={k!r}: must be None or an integer >= 1"):
            tfm.stream(model, ids, max_new_tokens=4, draft_model=model, num_draft_tokens=k)
