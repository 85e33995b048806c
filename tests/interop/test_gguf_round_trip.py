"""Round trips through llama.cpp (issue 29): what `torchformer train` makes (a char-level
shakespeare-char run, GPT-2-shaped) and a LoRA fine-tune merged into a Llama-shaped model, written
by convert --to-gguf / tfm.to_gguf in f16, run in llama.cpp with our greedy tokens, and the char
vocabulary tokenizes and detokenizes there as our char tokenizer does.

Tolerances: the file's f16 matrices are the numbers both sides run (ours rounded the same way);
llama.cpp rounds activations to f16 in F16 products and runs GPT-2's MLP with the tanh GELU where
the shakespeare-char preset uses the exact one, so logits differ by ~1e-3; greedy tokens of a
trained model are compared for equality (its top-2 margins are far wider than that)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

import torchformer as tfm
from tests.decoding import assert_varied
from torchformer.cli.main import main
from torchformer.interop import from_hf
from torchformer.interop.gguf import from_gguf, to_gguf

from .gguf_llamacpp import SHAPE, TEXTS, hf_folder, llama_detokenize, llama_greedy, llama_tokenize, need_llama_cpp

# One xdist worker for the GGUF tests (they share the converted files).
pytestmark = pytest.mark.xdist_group("gguf")

need_llama_cpp()


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):  # whole recomputation: the cached path is tested elsewhere against it
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    return out


def as_written_f16(model):
    """The model with its matrices rounded to f16 as to_gguf writes them (vectors stay f32)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    return model


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A seconds-long `torchformer train` run of the shakespeare-char preset (char tokenizer)."""
    from tests.training.tiny import tiny_recipe, words_text
    from torchformer.training.train import train

    root = tmp_path_factory.mktemp("char")
    data = root / "data.txt"
    data.write_text(words_text(300))
    run = train(tiny_recipe(root / "run", data, train={"steps": 150, "eval_every": 150, "batch_size": 16}))
    return root / "run", data.read_text(), run.tokenizer


def test_a_trained_char_run_runs_in_llama_cpp(char_run, tmp_path):
    run, text, char_tok = char_run
    out = tmp_path / "run.gguf"
    assert main(["convert", "--to-gguf", str(run), "--out", str(out)]) == 0
    sample = text[:300]
    ids = llama_tokenize(out, sample, add_bos=False)
    assert ids == char_tok.encode(sample).tolist()  # llama.cpp's BPE over the characters: one token each
    assert llama_detokenize(out, ids) == sample
    model = as_written_f16(tfm.load_any(run).eval())
    prompt = char_tok.encode("ROMEO\n").tolist()
    theirs = llama_greedy(out, prompt, 32)
    assert_varied(theirs, min_distinct=6)  # text of a char model: letters and spaces, not one repeated symbol
    assert greedy(model, prompt, 32) == theirs


def llama_folder(folder):
    """A tiny random HF Llama initialised at 0.1 (at 0.02 its greedy text is one token repeated)
    with the shared fixtures' byte-level BPE tokenizer."""
    import shutil

    import transformers

    cfg = transformers.LlamaConfig(**{**SHAPE, "tie_word_embeddings": False, "initializer_range": 0.1})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    shutil.copy(hf_folder("qwen3") / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_a_lora_merged_fine_tune_runs_in_llama_cpp(tmp_path):
    folder = llama_folder(tmp_path / "hf")
    model, tok = from_hf(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = torch.tensor([tok.encode(" ".join(TEXTS)).ids[:64]])
    with torch.no_grad():
        before = model(ids)[0]
    tfm.lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "mlp.down"))
    opt = torch.optim.AdamW(tfm.lora.trainable(model), lr=3e-3)
    model.train()
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    tfm.lora.merge(model).eval()
    with torch.no_grad():
        assert (model(ids)[0] - before).abs().max() > 0.1  # the fine-tune moved the model (a control)
    path = to_gguf(model, tmp_path / "ft.gguf", dtype="f16", tokenizer=tok)
    prompt = ids[0, :4].tolist()
    theirs = llama_greedy(path, prompt, 32)
    assert_varied(theirs)
    assert greedy(from_gguf(path), prompt, 32) == theirs
    assert greedy(as_written_f16(model), prompt, 32) == theirs  # the merged model itself, its f16 numbers
