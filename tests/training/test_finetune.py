"""Fine-tuning (issue 16): start from a trained model (model.init), full or LoRA; a held-out
play's validation loss goes down; LoRA checkpoints hold only adapters and resume bit-exactly;
an HF model fine-tuned and exported loads in transformers with equal logits; bad input."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import torchformer as tfm
from torchformer.training import recipe as recipes
from torchformer.training.corpus import VAL_EVERY, VAL_OFFSET, dialogue, play_files
from torchformer.training.train import train

from .tiny import tiny_hf_llama, tiny_recipe

LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "mlp.up"]}


def finetune_recipe(out, source, init, *, lora=None, model=None, **sections):
    """tiny_recipe's settings, with the model section replaced by model.init (+ safe changes)."""
    raw = tiny_recipe(out, source, **sections).to_dict()
    raw["model"] = {"init": str(init), **(model or {})}
    raw["finetune"] = {"lora": lora}
    return recipes.from_dict(raw)


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    """The trained default model's data: Shakespeare by play. The base trains on the training
    plays (the default recipe's split); one held-out play is the fine-tuning data."""
    root = tmp_path_factory.mktemp("plays")
    texts = [dialogue(text) for _, text in play_files()]
    held = [t for i, t in enumerate(texts) if i % VAL_EVERY == VAL_OFFSET]
    (root / "held_out.txt").write_text(held[0])
    torch.set_num_threads(1)
    base = train(
        tiny_recipe(
            root / "base",
            "shakespeare",
            model={"max_seq_len": 32},
            train={"steps": 150, "batch_size": 16, "eval_every": 150},
        )
    )
    return root, base


ALL_PROJECTIONS = {"rank": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.up", "mlp.down"]}


@pytest.mark.parametrize("lora, gain", [(None, 0.02), (ALL_PROJECTIONS, 0.005)], ids=["full", "lora"])
def test_finetuning_on_a_held_out_play_lowers_its_loss(plays, tmp_path, lora, gain):
    root, base = plays
    r = finetune_recipe(
        tmp_path / "ft",
        root / "held_out.txt",
        root / "base",
        lora=lora,
        optim={"lr": 1e-2 if lora else 3e-3, "weight_decay": 0.0 if lora else 0.1},  # adapters take larger steps
        train={"steps": 60, "eval_every": 60, "eval_batches": 8},
    )
    ft = train(r)
    before, after = ft.metrics[0]["val_loss"], ft.metrics[-1]["val_loss"]
    assert ft.metrics[0]["step"] == 0 and ft.metrics[-1]["step"] == 60
    # step 0 is the base model itself on the play's validation text (fixed windows: no noise). LoRA
    # cannot touch the embeddings and head, where most of a new play's novelty (names) lives.
    assert after < before - gain, (before, after)
    if lora:
        base_state = base.model.state_dict()
        for name, t in ft.model.state_dict().items():  # the frozen base did not move
            plain = name.replace(".base_layer", "")
            if ".lora_" not in name:
                assert torch.equal(t, base_state[plain]), name


def test_lora_checkpoint_holds_adapters_and_resume_is_bit_exact(plays, tmp_path):
    root, _ = plays
    settings = dict(lora={**LORA, "dropout": 0.1}, model={"dropout": 0.1})

    def make(out):
        return finetune_recipe(out, root / "held_out.txt", root / "base", train={"steps": 20}, **settings)

    straight = train(make(tmp_path / "a"))
    half = train(make(tmp_path / "b"), stop_after=10)
    resumed = train(make(tmp_path / "b"), resume="auto")
    a, b = tfm.lora.adapter_state(straight.model), tfm.lora.adapter_state(resumed.model)
    assert a.keys() == b.keys() and len(a) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(
        tfm.lora.adapter_state(half.model)["stack.blocks.0.attn.q_proj.lora_B.weight"],
        b["stack.blocks.0.attn.q_proj.lora_B.weight"],
    )
    ckpt = tmp_path / "b" / "checkpoints" / "step_000020"
    assert not (ckpt / "model.safetensors").exists()
    saved = load_file(str(ckpt / "adapters.safetensors"))
    assert saved.keys() == a.keys()
    optim = load_file(str(ckpt / "optimizer.safetensors"))
    # AdamW state (moments and step) for the 12 adapter tensors only
    assert set(optim) == {f"state.{i}.{k}" for i in range(len(a)) for k in ("exp_avg", "exp_avg_sq", "step")}
    state = json.loads((ckpt / "state.json").read_text())
    assert state["finetune"]["base"] == str(root / "base") and state["finetune"]["lora"]["rank"] == 4


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return tiny_hf_llama(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_hf_model_finetuned_and_exported_loads_in_transformers(hf_llama, corpus, tmp_path, lora):
    r = finetune_recipe(tmp_path / "ft", corpus, hf_llama, lora=lora, train={"steps": 8, "eval_every": 8})
    ft = train(r)
    model = tfm.lora.merge(ft.model) if lora else ft.model
    out = tfm.to_hf(model.eval(), tmp_path / "export")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = T.LlamaForCausalLM.from_pretrained(out).eval()(ids).logits
        original = T.LlamaForCausalLM.from_pretrained(hf_llama).eval()(ids).logits
        ours = model(ids)
    assert (ours - theirs).abs().max() < 1e-4
    assert (theirs - original).abs().max() > 1e-4  # it was trained


def _raw(tmp_path, corpus, **model):
    return tiny_recipe(tmp_path / "out", corpus).to_dict() | {"model": model}


@pytest.mark.parametrize(
    "model, match",
    [
        ({"init": "/no/such/folder"}, r"model.init='/no/such/folder'.*neither a folder"),
        ({"init": "meta-llama/Llama-3.2-1B"}, r"Hub ids are not downloaded"),
        ({"init": "BASE", "d_model": 64}, r"model.d_model cannot change when starting from model.init.*Allowed: init"),
        ({"init": "BASE", "attention": {"n_heads": 4}}, r"model.attention.n_heads cannot change"),
    ],
)
def test_bad_init(plays, tmp_path, corpus, model, match):
    root, _ = plays
    model = {k: (str(root / "base") if v == "BASE" else v) for k, v in model.items()}
    with pytest.raises(ValueError, match=match):
        recipes.from_dict(_raw(tmp_path, corpus, **model))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "lora, match",
    [
        ({"rank": 0}, r"finetune.lora: invalid LoRA settings:\n  - rank=0: must be an integer >= 1"),
        ({"size": 3}, r"finetune.lora: unknown \['size'\]; allowed keys"),
        ({"targets": ["qkv_proj"]}, r"'qkv_proj' matches no linear module.*attn.q_proj"),
    ],
)
def test_bad_lora_nothing_written(plays, tmp_path, lora, match):
    root, _ = plays
    with pytest.raises(ValueError, match=match):
        train(finetune_recipe(tmp_path / "out", root / "held_out.txt", root / "base", lora=lora))
    assert not (tmp_path / "out").exists()


def test_max_seq_len_only_down_and_cut(plays, tmp_path):
    root, base = plays
    up = finetune_recipe(tmp_path / "up", root / "held_out.txt", root / "base", model={"max_seq_len": 64})
    with pytest.raises(ValueError, match="model.max_seq_len=64: model.init has 32; it can only go down"):
        train(up)
    down = finetune_recipe(
        tmp_path / "down", root / "held_out.txt", root / "base", model={"max_seq_len": 16}, train={"steps": 1}
    )
    assert train(down).model.config.max_seq_len == 16


def test_non_utf8_data_names_file_and_offset(plays, tmp_path):
    root, _ = plays
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf" + "\xe1 ol\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text \(byte 0xe1 at byte offset 3"):
        train(tiny_recipe(tmp_path / "out", bad))
    assert not (tmp_path / "out").exists()


def test_packaged_lora_recipe_loads(plays):
    root, _ = plays
    r = recipes.load("lora-shakespeare", [f"model.init={root / 'base'}", f"data.source={root / 'held_out.txt'}"])
    assert r.finetune.lora.rank == 8 and r.model["init"] == str(root / "base")
    with pytest.raises(ValueError, match="model.init='runs/nowhere'"):
        recipes.load("lora-shakespeare", ["model.init=runs/nowhere"])


def test_preset_init_builds_from_scratch(tmp_path, corpus):
    r = finetune_recipe(
        tmp_path / "p", corpus, "llama-tiny", model={"max_seq_len": 32}, lora=LORA, train={"steps": 2, "eval_every": 2}
    )
    result = train(r)
    assert result.model.config.d_model == tfm.presets.get("llama-tiny").d_model
    assert result.model.config.max_seq_len == 32 and tfm.lora.adapters(result.model)
