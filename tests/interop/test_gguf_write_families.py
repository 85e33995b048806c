"""tfm.to_gguf for the architectures we read (issue 29): each family's tiny Hugging Face model (the
parity fixtures of gguf_llamacpp.py, initialised for varied greedy text) loaded by from_hf,
written by to_gguf and run by llama.cpp: F16 greedy 32 tokens equal ours and are varied, logits
within test_gguf_parity's F16 bound (the file's numbers on both sides, llama.cpp's f16 activations);
Q8_0 logits within its quantized bound (llama.cpp's 8-bit activations), the argmax mostly the same.
A model llama.cpp's graph would run as another model is refused before anything is written."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from tokenizers import Tokenizer

import torchformer as tfm
from tests.decoding import assert_varied
from torchformer.interop import from_hf
from torchformer.interop.gguf import from_gguf, to_gguf

from .gguf_llamacpp import hf_folder, llama_greedy, llama_logits, need_llama_cpp
from .test_gguf_parity import IDS, TOL, assert_quantized_close, our_greedy

# One xdist worker for the GGUF tests (they share the fixtures' folders).
pytestmark = pytest.mark.xdist_group("gguf")

# fixture -> the architecture written: the first family (interop/hf.py's order) whose file reads
# back as the model; a Phi-3 without LongRoPE is a Llama config and runs in llama.cpp's llama graph.
WRITTEN = {
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "llama",
    "phi3-long": "phi3",
    "qwen2": "qwen2",
    "olmo2": "olmo2",
    "gptneox": "gptneox",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
}


def bpe():
    """The fixtures' byte-level BPE (Gemma and Phi-3 fixtures carry SentencePiece, which to_gguf
    does not write); padded to each model's vocabulary."""
    return Tokenizer.from_file(str(hf_folder("qwen3") / "tokenizer.json"))


def as_written(model):
    """``model`` with the numbers to_gguf writes in F16: matrices f16; vectors, MoE routers and
    Qwen2-MoE's shared-expert gate f32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith(("router.weight", "shared.gate.weight")):
                p.copy_(p.half().float())
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]  # (T, V)


@pytest.mark.parametrize("family", list(WRITTEN))
def test_llama_cpp_runs_the_written_file_as_our_model(tmp_path, family):
    need_llama_cpp()
    model = from_hf(hf_folder(family)).eval()
    f16 = to_gguf(model, tmp_path / "f16.gguf", tokenizer=bpe())
    assert gguf.GGUFReader(f16).fields["general.architecture"].contents() == WRITTEN[family]
    back = from_gguf(f16)
    assert (logits(back, IDS) - llama_logits(f16, IDS)).abs().max() < TOL[family]["F16"]
    theirs = llama_greedy(f16, IDS[:4], 32)
    assert_varied(theirs)  # measured 16-31 distinct tokens in 32
    assert our_greedy(back, IDS[:4], 32) == theirs
    q8 = to_gguf(model, tmp_path / "q8_0.gguf", dtype="q8_0", tokenizer=bpe())
    assert_quantized_close(family, logits(from_gguf(q8), IDS), llama_logits(q8, IDS))
    # The source model itself, not only the file read back: a change made the same wrong way by
    # writer and reader (a Q/K permutation not redone, undone again) runs differently in llama.cpp.
    source = as_written(model)
    assert (logits(source, IDS) - llama_logits(f16, IDS)).abs().max() < TOL[family]["F16"]
    assert our_greedy(source, IDS[:4], 32) == theirs


def changed(family: str, **paths):
    """The fixture's model with ``paths`` (``attention.scale``, ``moe.renormalize``) set."""
    cfg = from_hf(hf_folder(family)).config
    subs = {}
    for path, value in paths.items():
        head, _, leaf = path.partition(".")
        subs[head] = dataclasses.replace(subs.get(head, getattr(cfg, head)), **{leaf: value})
    return tfm.build_model(cfg.replace(**subs))


@pytest.mark.parametrize(
    "family, paths, message",
    [
        # transformers' Gemma 2 default query_pre_attn_scalar (256 here, not head_dim 64): llama.cpp
        # scales scores by head_dim ** -0.5 for every Gemma 2 but the 27B
        ("gemma2", {"attention.scale": 256**-0.5}, r"GGUF gemma2 .*attention\.scale=0\.0625"),
        # llama.cpp's qwen3moe graph always renormalises the top-k weights
        ("qwen3moe", {"moe.renormalize": False}, r"GGUF qwen3moe .*moe\.renormalize=False"),
    ],
)
def test_a_model_llama_cpp_would_run_differently_is_refused_before_writing(tmp_path, family, paths, message):
    with pytest.raises(ValueError, match=message):
        to_gguf(changed(family, **paths), tmp_path / "x.gguf", tokenizer=bpe())
    assert not list(tmp_path.iterdir())
