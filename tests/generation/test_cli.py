"""`torchformer generate` on a checkpoint saved by tfm.save, with and without a tokenizer."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import torchformer as tfm
from torchformer.cli.main import main

TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer " * 20


def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = byte_bpe()
    cfg = tfm.presets.get("llama-tiny", vocab_size=tok.get_vocab_size(), n_layers=1, max_seq_len=64)
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt")
    tfm.save(model, path, extra_files={"tokenizer.json": tok.to_str()})
    return path, model, tok


def test_prompt_text_matches_the_library(checkpoint, capsys):
    path, model, tok = checkpoint
    assert main(["generate", str(path), "--prompt", "to be or", "--max-new-tokens", "6"]) == 0
    ids = torch.tensor([tok.encode("to be or").ids])
    expected = tfm.generate(model, ids, max_new_tokens=6)[0].tolist()
    assert capsys.readouterr().out == tok.decode(expected) + "\n"


def test_stream_prints_the_same_text_and_verbose_reports_speed(checkpoint, capsys):
    path, _, _ = checkpoint
    args = ["generate", str(path), "--prompt", "to be or", "--max-new-tokens", "6", "--temperature", "0.8"]
    main([*args, "--seed", "1"])
    plain = capsys.readouterr().out
    main([*args, "--seed", "1", "--stream", "--verbose"])
    out = capsys.readouterr()
    assert out.out == plain
    assert "tokens/s" in out.err


def test_ids_without_tokenizer(tmp_path, capsys):
    torch.manual_seed(0)
    model = tfm.build_model(tfm.presets.get("llama-tiny", n_layers=1)).eval()
    tfm.save(model, tmp_path)
    assert main(["generate", str(tmp_path), "--ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    expected = tfm.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)[0].tolist()
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    assert main(["generate", str(tmp_path), "--ids", "1,2,3", "--max-new-tokens", "4", "--stream"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))


def test_user_errors_are_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    tfm.save(tfm.build_model(tfm.presets.get("llama-tiny", n_layers=1)), tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    assert "use --ids" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--ids", "1,x"]) == 2
    assert "--ids '1,x'" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--ids", "1", "--top-p", "3"]) == 2
    assert "top_p=3.0" in capsys.readouterr().err
