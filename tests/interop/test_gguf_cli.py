"""Every command that takes a model takes a .gguf file (issue 29): convert --from-gguf writes a
Hugging Face folder equal to the one llama.cpp's converter read; generate, plan, verify and eval
run on the file with its own tokenizer; serve does chat with the file's chat template."""

from __future__ import annotations

import json

import pytest
import torch

import torchformer as tfm
from torchformer.cli.main import main
from torchformer.interop import from_hf

from .gguf_llamacpp import TEXTS, gguf_file, hf_folder

# One xdist worker makes the GGUF files once (a conversion takes ~15 s).
pytestmark = pytest.mark.xdist_group("gguf")


def test_convert_from_gguf_gives_back_the_hf_weights(tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", "--from-gguf", str(gguf_file("llama")), "--out", str(out)]) == 0
    original, back = from_hf(hf_folder("llama")), from_hf(out)
    a, b = original.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # q/k permutation undone exactly
    # Llama 3's RoPE scaling comes back as its per-frequency divisors (the file's rope_freqs, float32)
    assert back.config == original.config.replace(positions=back.config.positions)
    ids = torch.tensor([[1, 40, 77, 300, 12]])
    with torch.no_grad():
        assert (original(ids) - back(ids)).abs().max() < 1e-5
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_generate_plan_verify_eval_on_a_gguf_file(tmp_path, capsys):
    path = str(gguf_file("llama-tied"))
    assert main(["generate", path, "--prompt", "Hello world", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    model, tok = tfm.from_gguf(path), tfm.load_tokenizer(path)
    prompt = tok.encode("Hello world").ids
    eos = tok.token_to_id("</s>")  # the CLI stops at the file's EOS (this fixture's second token)
    new = tfm.generate(model, torch.tensor([prompt]), max_new_tokens=6, eos_token_id=eos)[0, len(prompt) :].tolist()
    assert tok.decode(new) in printed
    assert main(["plan", path]) == 0 and "2 layers" in capsys.readouterr().out
    assert main(["verify", path]) == 0
    capsys.readouterr()
    data = tmp_path / "text.txt"
    data.write_text("\n".join(TEXTS))
    assert main(["eval", path, "--data", str(data)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == path


def test_serve_a_gguf_file_does_chat():
    from tests.serve.conftest import client
    from tests.serve.test_cli import ready, start, stop

    proc, lines = start([str(gguf_file("llama")), "--slots", "1", "--served-model-name", "g"])
    try:
        out = client(ready(proc, lines)).chat.completions.create(
            model="g", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    finally:
        stop(proc)
    tok = tfm.load_tokenizer(gguf_file("llama"))
    assert out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens == len(tok.encode("<|user|>hi<|assistant|>").ids)  # the file's template


def test_a_recipe_fine_tunes_from_a_gguf_file(tmp_path):
    from tests.training.tiny import tiny_recipe
    from torchformer.training import recipe as recipes
    from torchformer.training.train import train

    data = tmp_path / "data.txt"
    data.write_text("\n".join(TEXTS * 20))
    raw = tiny_recipe(tmp_path / "ft", data, train={"steps": 2, "eval_every": 2}).to_dict()
    raw["model"] = {"init": str(gguf_file("llama-tied"))}
    raw["finetune"] = {"lora": None}
    run = train(recipes.from_dict(raw))
    start = tfm.from_gguf(gguf_file("llama-tied"))
    assert run.model.config == start.config
    tok = tfm.load_tokenizer(tmp_path / "ft")  # the run keeps the file's tokenizer
    assert tok.encode(TEXTS[2]).ids == tfm.load_tokenizer(gguf_file("llama-tied")).encode(TEXTS[2]).ids
    moved = [n for n, t in run.model.state_dict().items() if not torch.equal(t, start.state_dict()[n])]
    assert moved  # it trained from the file's weights
