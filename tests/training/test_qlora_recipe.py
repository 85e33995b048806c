"""QLoRA from a recipe (finetune.quantize): LoRA adapters train over a frozen int8 / int4 base built
from model.init (an HF Llama folder), only the adapters are trainable and the quantized base equals
a fresh quantization of the init; checkpoints hold adapters plus the base reference and scheme;
resume is bit-exact and refused over another base; the PEFT adapter loads onto a fresh quantized
base (identical logits) and into peft on the float transformers model; the CLI trains it; bad
settings are errors naming the field, the value and what is allowed, before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.lora.layer import FrozenQuantized, LoRALinear
from torchformer.nn.quant import Int4Linear, Int8Linear
from torchformer.training import recipe as recipes
from torchformer.training.train import train

from .tiny import tiny_hf_llama, tiny_recipe

LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "mlp.up"]}
SCHEMES = {"int8": (Int8Linear, None), "int4": (Int4Linear, 16)}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return tiny_hf_llama(tmp_path_factory.mktemp("hf"))


def qlora_recipe(out, source, init, *, finetune, model=None, **sections):
    raw = tiny_recipe(out, source, optim={"lr": 1e-2, "weight_decay": 0.0}, **sections).to_dict()
    raw["model"] = {"init": str(init), **(model or {})}
    raw["finetune"] = finetune
    return recipes.from_dict(raw)


def _quantized_base(init, scheme, group_size):
    return tfm.quantize(tfm.load_any(str(init)), scheme, group_size=group_size, lm_head=False)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qlora_recipe_trains_adapters_over_a_quantized_base(hf_llama, corpus, tmp_path, scheme):
    kind, group = SCHEMES[scheme]
    finetune = {"lora": LORA, "quantize": scheme, **({"group_size": group} if group else {})}
    out = tmp_path / "q"
    result = train(qlora_recipe(out, corpus, hf_llama, finetune=finetune, train={"steps": 12, "eval_every": 12}))
    model = result.model
    block = model.stack.blocks[0]
    assert isinstance(block.attn.q_proj, LoRALinear) and isinstance(block.attn.q_proj.base_layer, kind)
    assert isinstance(block.attn.k_proj, FrozenQuantized) and isinstance(block.attn.k_proj.base_layer, kind)
    assert type(model.lm_head) is not FrozenQuantized and model.lm_head.weight.dtype == torch.float32
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    # The frozen base is exactly a fresh quantization of model.init: training never touched it.
    fresh = _quantized_base(hf_llama, scheme, group).state_dict()
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, fresh[name.replace(".base_layer", "")]), name
    first, last = result.metrics[0]["val_loss"], result.metrics[-1]["val_loss"]
    assert last < first - 0.01, (first, last)

    ckpt = out / "checkpoints" / "step_000012"
    assert not (ckpt / "model.safetensors").exists()
    adapters = tfm.lora.adapter_state(model)
    assert load_file(str(ckpt / "adapters.safetensors")).keys() == adapters.keys()
    optim = load_file(str(ckpt / "optimizer.safetensors"))
    assert {k.split(".")[1] for k in optim} == {str(i) for i in range(len(adapters))}  # adapter state only
    record = json.loads((ckpt / "state.json").read_text())["finetune"]
    assert record["base"] == str(hf_llama) and record["quantize"] == {"scheme": scheme, "group_size": group}

    # The PEFT adapter of the run folder: onto a fresh quantized base it gives the trained model's
    # logits exactly; peft loads it onto the float transformers model like our float base + adapter.
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    again = tfm.lora.load(_quantized_base(hf_llama, scheme, group), out / "adapter").eval()
    float_ours = tfm.lora.load(tfm.load_any(str(hf_llama)), out / "adapter").eval()
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(T.LlamaForCausalLM.from_pretrained(hf_llama), out / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(again(ids), model.eval()(ids))
        assert (theirs(ids).logits - float_ours(ids)).abs().max() < 1e-4
        # The run folder's model: the adapters merged into the float init (tfm.load opens the run).
        merged = tfm.load(out)
        assert not any(isinstance(m, kind) for m in merged.modules())
        assert (merged(ids) - float_ours(ids)).abs().max() < 1e-5
        assert (merged(ids) - model(ids)).abs().max() > 0  # the trained model's base is quantized


def test_qlora_resume_is_bit_exact_and_refused_over_another_base(hf_llama, corpus, tmp_path):
    def make(out, scheme="int8", group=None):
        finetune = {"lora": {**LORA, "dropout": 0.1}, "quantize": scheme, "group_size": group}
        return qlora_recipe(out, corpus, hf_llama, finetune=finetune, model={"dropout": 0.1}, train={"steps": 10})

    straight = train(make(tmp_path / "a"))
    half = train(make(tmp_path / "b"), stop_after=5)
    with pytest.raises(ValueError, match=r"--resume .*step_000005: its adapters were trained with finetune .*'int8'"):
        train(make(tmp_path / "b", "int4", 16), resume="auto")
    resumed = train(make(tmp_path / "b"), resume="auto")
    a, b = tfm.lora.adapter_state(straight.model), tfm.lora.adapter_state(resumed.model)
    assert a.keys() == b.keys() and len(a) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    for name in a:
        assert torch.equal(a[name], b[name]), name
    key = "stack.blocks.0.attn.q_proj.lora_B.weight"
    assert not torch.equal(tfm.lora.adapter_state(half.model)[key], b[key])
    assert straight.metrics[-1]["val_loss"] == resumed.metrics[-1]["val_loss"]


def test_cli_trains_qlora_from_recipe_overrides(hf_llama, corpus, tmp_path, capsys):
    recipe_file = tmp_path / "r.json"
    recipe_file.write_text(
        json.dumps(qlora_recipe(tmp_path / "x", corpus, hf_llama, finetune={"lora": LORA}).to_dict())
    )
    out = tmp_path / "cli"
    argv = ["train", "--recipe", str(recipe_file), "--out", str(out), "finetune.quantize=int8", "train.steps=3"]
    assert main(argv) == 0
    state = json.loads((out / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["finetune"]["quantize"] == {"scheme": "int8", "group_size": None}
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "adapters.safetensors").is_file()


@pytest.mark.parametrize(
    "finetune, match",
    [
        ({"lora": LORA, "quantize": "int3"}, r"finetune\.quantize='int3': must be one of \['int4', 'int8'\]"),
        ({"quantize": "int8"}, r"finetune\.quantize='int8' needs finetune\.lora: a quantized base is frozen"),
        (
            {"lora": LORA, "quantize": "int8", "group_size": 32},
            r"finetune\.group_size=32 with finetune\.quantize='int8'",
        ),
        ({"lora": LORA, "group_size": 32}, r"finetune\.group_size=32 with finetune\.quantize=None: .*int4 only"),
        ({"lora": LORA, "quantize": 8}, r"finetune\.quantize=8: must be str \| None"),
        ({"lora": LORA, "quantize": "int4", "group_size": "16"}, r"finetune\.group_size='16': must be int \| None"),
    ],
)
def test_bad_quantize_settings_at_recipe_time(hf_llama, corpus, tmp_path, finetune, match):
    with pytest.raises(ValueError, match=match):
        qlora_recipe(tmp_path / "out", corpus, hf_llama, finetune=finetune)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "group, match",
    [
        (3, r"finetune\.quantize='int4' \(group_size=3\): group_size=3: must be an even integer >= 2"),
        (None, r"group_size=64 does not divide in_features=32 of stack\.blocks\.0\.attn\.q_proj"),  # the default
    ],
)
def test_group_size_checked_against_the_model_before_any_work(hf_llama, corpus, tmp_path, group, match):
    finetune = {"lora": LORA, "quantize": "int4", "group_size": group}
    recipe = qlora_recipe(tmp_path / "out", corpus, hf_llama, finetune=finetune)
    with pytest.raises(ValueError, match=match):
        train(recipe)
    assert not (tmp_path / "out").exists()


def test_quantize_over_an_already_quantized_init_is_refused(hf_llama, corpus, tmp_path):
    q = tfm.quantize(tfm.load_any(str(hf_llama)), "int8", lm_head=False)
    tfm.save(q, tmp_path / "q", extra_files={"tokenizer.json": (hf_llama / "tokenizer.json").read_text()})
    recipe = qlora_recipe(tmp_path / "out", corpus, tmp_path / "q", finetune={"lora": LORA, "quantize": "int4"})
    with pytest.raises(
        ValueError, match=r"finetune\.quantize='int4': model\.init=.* is already quantized \(scheme='int8'\)"
    ):
        train(recipe)
    assert not (tmp_path / "out").exists()
