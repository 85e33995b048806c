"""`torchformer convert --from-hf` / `--to-hf`."""

from __future__ import annotations

import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.interop import from_hf


def test_convert_from_hf_and_back(hf_model, tmp_path, capsys):
    folder, _ = hf_model("qwen2")
    (folder / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["convert", "--from-hf", str(folder), "--out", str(ckpt)]) == 0
    assert "torchformer checkpoint" in capsys.readouterr().out
    assert (ckpt / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    original, converted = from_hf(folder), tfm.load(ckpt)
    for key, tensor in original.state_dict().items():
        assert torch.equal(converted.state_dict()[key], tensor), key
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(back)]) == 0
    assert (back / "tokenizer.json").is_file()
    for key, tensor in from_hf(back).state_dict().items():
        assert torch.equal(original.state_dict()[key], tensor), key


def test_convert_interleaved_and_errors(hf_model, tmp_path, capsys):
    folder, _ = hf_model("llama")
    out = tmp_path / "inter"
    assert main(["convert", "--from-hf", str(folder), "--out", str(out), "--rope-pairing", "interleaved"]) == 0
    assert tfm.load(out).config.positions.pairing == "interleaved"
    assert main(["convert", "--from-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "not a local folder" in capsys.readouterr().err


def test_generate_runs_on_an_hf_folder(tmp_path, capsys):
    """`torchformer generate HF_DIR --prompt ...`: the folder's tokenizer.json and weights, greedy
    output equal to transformers' generate."""
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=280, initial_alphabet=alphabet),
    )
    config = T.GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.5,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = T.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    prompt = tok.encode("the quick fox").ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
    assert main(["generate", str(tmp_path), "--prompt", "the quick fox", "--max-new-tokens", "8"]) == 0
    assert tok.decode(want[len(prompt) :]) in capsys.readouterr().out
