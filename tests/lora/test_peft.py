"""PEFT compatibility: a LoRA-trained tiny HF Llama's adapter, saved by tfm.lora.save and loaded
by peft.PeftModel.from_pretrained onto the transformers model, gives our logits (1e-4); a PEFT
adapter loads into ours; merged + to_hf loads in transformers with the same logits."""

from __future__ import annotations

import dataclasses

import peft  # a dev dependency (pyproject), so this test always runs
import pytest
import torch
import transformers as T

import torchformer as tfm

CFG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TARGETS = {
    "qv": ("q_proj", "v_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate", "mlp.up", "mlp.down", "lm_head"),
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf-llama")
    T.LlamaForCausalLM(T.LlamaConfig(**CFG)).save_pretrained(folder)
    return folder


def _hf(folder):
    return T.LlamaForCausalLM.from_pretrained(folder).eval()


def _lora_train(model, steps=5):
    """A few AdamW steps on random data, so A and B are both non-trivial."""
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(tfm.lora.trainable(model), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, CFG["vocab_size"], (4, 12), generator=g)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


IDS = torch.randint(0, CFG["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("targets", list(TARGETS), ids=list(TARGETS))
def test_our_adapter_loads_in_peft(hf_folder, tmp_path, pairing, targets):
    model = tfm.from_hf(hf_folder, rope_pairing=pairing)
    tfm.lora.apply(model, rank=4, alpha=8, targets=TARGETS[targets])
    _lora_train(model)
    assert all(m.lora_B.weight.abs().max() > 0 for m in tfm.lora.adapters(model).values())
    tfm.lora.save(model, tmp_path / "adapter", base_model=str(hf_folder))
    theirs = peft.PeftModel.from_pretrained(_hf(hf_folder), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        ours_logits = model(IDS)
        base_logits = _hf(hf_folder)(IDS).logits
        peft_logits = theirs(input_ids=IDS).logits
    assert (ours_logits - base_logits).abs().max() > 1e-3  # the adapter changed the model
    assert (ours_logits - peft_logits).abs().max() < 1e-4
    # and back: our loader reads the folder into a fresh base
    again = tfm.lora.load(tfm.from_hf(hf_folder, rope_pairing=pairing), tmp_path / "adapter")
    with torch.no_grad():
        assert (again(IDS) - ours_logits).abs().max() < 1e-5


def test_peft_adapter_loads_in_ours(hf_folder, tmp_path):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    theirs = peft.get_peft_model(_hf(hf_folder), cfg)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    theirs.save_pretrained(tmp_path / "adapter")
    ours = tfm.lora.load(tfm.from_hf(hf_folder), tmp_path / "adapter")
    assert sorted(n.split(".")[-1] for n in tfm.lora.adapters(ours)) == ["down"] * 2 + ["q_proj"] * 2 + ["v_proj"] * 2
    with torch.no_grad():
        assert (ours(IDS) - theirs.eval()(input_ids=IDS).logits).abs().max() < 1e-4


def test_merged_and_exported_loads_in_transformers(hf_folder, tmp_path):
    model = tfm.from_hf(hf_folder)
    tfm.lora.apply(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "mlp.up"))
    _lora_train(model)
    with torch.no_grad():
        unmerged = model(IDS)
    tfm.to_hf(tfm.lora.merge(model), tmp_path / "merged")
    with torch.no_grad():
        assert (_hf(tmp_path / "merged")(IDS).logits - unmerged).abs().max() < 1e-4


def test_fused_layout_and_bad_folders_are_refused(tmp_path):
    big = tfm.presets.get("gpt2-small")
    small = big.replace(
        n_layers=1,
        d_model=64,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=0,
        attention=dataclasses.replace(big.attention, n_heads=4),
    )
    gpt2 = tfm.build_model(small)
    tfm.lora.apply(gpt2, rank=2, targets=("q_proj",))
    with pytest.raises(ValueError, match="fused"):
        tfm.lora.save(gpt2, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="carries no LoRA adapters"):
        tfm.lora.save(tfm.build_model(tfm.presets.get("llama-tiny")), tmp_path / "y")
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter folder"):
        tfm.lora.load(tfm.build_model(tfm.presets.get("llama-tiny")), tmp_path)


def test_eval_cli_applies_a_peft_adapter(tmp_path, capsys):
    import json

    from torchformer.cli.main import main
    from torchformer.evaluation import strided_nll
    from torchformer.training.tokenizers import build_tokenizer

    tok = build_tokenizer("byte", "")
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**{**CFG, "vocab_size": 272})).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(tok.to_json())
    model = tfm.lora.apply(tfm.from_hf(tmp_path / "hf"), rank=4, targets=("q_proj", "v_proj"))
    _lora_train(model)
    tfm.lora.save(model, tmp_path / "adapter")
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 2
    (tmp_path / "sonnet.txt").write_text(text)
    argv = ["eval", str(tmp_path / "hf"), "--data", str(tmp_path / "sonnet.txt"), "--seq-len", "32", "--no-progress"]
    assert main([*argv, "--adapter", str(tmp_path / "adapter")]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = strided_nll(model, torch.as_tensor(tok.encode(text)), seq_len=32, stride=16)
    assert out["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert main(argv) == 0  # without the adapter: the base model's (different) loss
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(expected.loss, rel=1e-3)
