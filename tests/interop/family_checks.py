"""The equalities every family added in issue 14 part C is held to, as functions the per-family
test files call: logits (hidden states for encoders) against transformers on a padded 4 x 64
batch, greedy 16 tokens against ``generate``, HF -> torchformer -> HF through transformers'
own loader, torchformer -> HF -> torchformer bit-equal, and ``verify``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import torchformer as tfm
from torchformer.interop import from_hf, to_hf
from torchformer.verify import verify

from ..decoding import assert_varied
from .test_parity import hf_positions, left_padded, until_eos, varied_left_padded

TOL = 1e-4
PADS = [0, 3, 17, 40]  # left pads of the 4 x 64 decoder batch


def saved(cls, config, folder: Path, seed: int = 1234, embed_scale: float = 1.0):
    """A random HF model of ``cls`` for ``config`` in eval mode, saved to ``folder``. embed_scale
    multiplies the token embeddings (Gemma's, scaled by sqrt(d) on the way in, otherwise drown
    the blocks' output and greedy decoding repeats one token)."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    if embed_scale != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def decoder_max_diff(folder: Path, hf, vocab: int) -> float:
    """Max |ours - HF| over the real tokens of a left-padded 4 x 64 batch, and unpadded."""
    ours = from_hf(folder)
    ids, mask = left_padded(4, 64, vocab, PADS)
    want = hf(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
    got = ours(ids, attention_mask=mask)
    real = mask.bool()
    unpadded = (ours(ids[:1]) - hf(input_ids=ids[:1]).logits).abs().max()
    return max((got[real] - want[real]).abs().max().item(), unpadded.item())


@torch.no_grad()
def decoder_greedy_equal(folder: Path, hf, vocab: int, pad: int = 0) -> None:
    ours = from_hf(folder)
    ids, mask = varied_left_padded(hf, vocab, pad)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, num_beams=1, pad_token_id=pad)
    got = tfm.generate(ours, ids, attention_mask=mask, max_new_tokens=16)
    eos = hf.generation_config.eos_token_id
    for row_got, row_want in zip(got.tolist(), want.tolist()):
        row_want = until_eos(row_want[6:], eos)
        assert_varied(row_want, 8, "HF's greedy tokens up to EOS")  # a real comparison: no early stop, no repeat
        assert row_got[6 : 6 + len(row_want)] == row_want


@torch.no_grad()
def hf_round_trip(folder: Path, hf, auto, out: Path, run, model_type: str | None = None, head: str = "") -> None:
    """from_hf then to_hf: transformers loads the export with no missing or unexpected keys, the
    same tensors and the same outputs (``run(model)`` -> tensor). ``head``: the prefix of a task
    head torchformer drops on load (RoBERTa's pooler), which transformers then initialises."""
    export = to_hf(from_hf(folder), out, model_type=model_type)
    again, info = auto.from_pretrained(export, output_loading_info=True)
    again.eval()
    assert type(again) is type(hf)
    assert not [k for k in info["missing_keys"] if not (head and k.startswith(head))], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    before = hf.state_dict()
    for key, tensor in again.state_dict().items():
        if not (head and key.startswith(head)):
            assert torch.equal(tensor, before[key]), key
    if head:  # the freshly initialised head must not enter the comparison below
        again.load_state_dict({k: v for k, v in before.items() if k.startswith(head)}, strict=False)
    torch.manual_seed(0)
    want = run(hf)
    torch.manual_seed(0)
    assert torch.equal(run(again), want)


def randomised(cfg: tfm.ModelConfig) -> torch.nn.Module:
    """Every parameter random (norm weights and biases too), so a bit-equal check sees all of them."""
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@torch.no_grad()
def ours_round_trip(cfg: tfm.ModelConfig, out: Path, model_type: str) -> None:
    """torchformer -> HF -> torchformer: the same config, bit-equal tensors (the state dict and the
    buffers loading recomputes: position tables), outputs equal to 1e-5 (below)."""
    model = randomised(cfg)
    again = from_hf(to_hf(model, out, model_type=model_type))
    assert again.config == cfg
    before, after = model.state_dict(), again.state_dict()
    before.update(("buffer " + k, b) for k, b in model.named_buffers())  # non-persistent ones too
    after.update(("buffer " + k, b) for k, b in again.named_buffers())
    assert set(before) == set(after)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    ids = torch.randint(3, cfg.vocab_size, (2, 12))
    run = (lambda m: m(ids, ids[:, :5])) if cfg.arch == "encoder_decoder" else (lambda m: m(ids))
    want, got = run(model), run(again)
    # Equal tensors; the outputs may differ in the last bits only because the loaded tensors are
    # memory-mapped at offsets MKL's kernels treat differently from freshly allocated ones.
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def verify_passes(folder: Path) -> None:
    report = verify(from_hf(folder), untrained=False, flop_budget=3e7)
    assert report.ok, report.table()


def unloadable_with(folder: Path, out: Path, match: str, **changes) -> None:
    """from_hf of a copy of ``folder`` whose config.json has ``changes`` raises a ValueError
    matching ``match``; its weights file is garbage, so the error must come before any read."""
    shutil.copytree(folder, out, dirs_exist_ok=True)
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    hf = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(hf, **changes)))
    with pytest.raises(ValueError, match=match):
        from_hf(out)
