"""A quantizing load (``tfm.load_any(..., quantize=)``, what ``generate`` / ``serve --quantize`` run)
gives the very modules ``tfm.quantize`` gives after a plain load, while holding the integer model
only: the mapped float bytes it read go back (``host_memory.release_mapped``), never a float copy."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import torchformer as tfm
from torchformer.host_memory import release_mapped
from torchformer.models.saving import open_safetensors

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")


@linux
def test_release_mapped_drops_a_mapped_tensors_pages_and_keeps_its_values(tmp_path):
    want = torch.randn(2048, 1024)  # 8 MiB
    save_file({"w": want}, str(tmp_path / "w.safetensors"))
    w = open_safetensors(tmp_path / "w.safetensors").get_tensor("w")
    assert torch.equal(w, want)  # every page read: resident
    before = rss_kib()
    released = release_mapped(w)
    assert released >= 8 * 2**20 - 2 * 4096  # all whole pages inside the tensor
    assert before - rss_kib() >= 6 * 1024  # they left this process's resident set
    assert torch.equal(w, want)  # and fault back in from the file, unchanged


def test_release_mapped_never_touches_heap_memory():
    """The negative control: madvise(DONTNEED) on anonymous memory would zero it."""
    t = torch.randn(1024, 1024)
    copy = t.clone()
    assert release_mapped(t) == 0
    assert torch.equal(t, copy)


def tiny_llama(folder, *, vocab=256, hidden=64, layers=2, dtype=torch.bfloat16, tie=True):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantizing-load")
    hf = tiny_llama(root / "hf")
    tfm.save(tfm.load_any(hf), root / "ours")
    return {"hf": hf, "ours": root / "ours"}


@pytest.mark.parametrize("kind", ["hf", "ours"])
@pytest.mark.parametrize(("scheme", "group"), [("int8", None), ("int4", 32)])
def test_a_quantizing_load_equals_quantize_after_a_plain_load(folders, kind, scheme, group):
    loaded = tfm.load_any(folders[kind], quantize=scheme, group_size=group)
    reference = tfm.quantize(tfm.load_any(folders[kind]), scheme, group_size=group)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in reference.modules()]
    a, b = loaded.state_dict(), reference.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(loaded(IDS), reference(IDS))
    assert loaded.embed.tok.weight.dtype == torch.bfloat16  # the input table stays as stored


def test_quantize_arguments_are_checked_before_any_weight_is_read(folders, monkeypatch):
    from torchformer.interop import hf as hf_module

    def must_not_read(*args, **kwargs):
        raise AssertionError("weights were read before the quantization arguments were checked")

    monkeypatch.setattr(hf_module, "SafetensorsFolder", must_not_read)
    with pytest.raises(ValueError, match=r"group_size=48 does not divide in_features=64"):
        tfm.load_any(folders["hf"], quantize="int4", group_size=48)
    with pytest.raises(ValueError, match=r"scheme='int3'.*int4.*int8"):
        tfm.load_any(folders["hf"], quantize="int3")
    with pytest.raises(ValueError, match=r"group_size=32.*needs quantize='int4'"):
        tfm.load_any(folders["hf"], group_size=32)


@linux
def test_an_already_quantized_checkpoint_is_named(folders, tmp_path):
    tfm.save(tfm.load_any(folders["ours"], quantize="int8"), tmp_path / "q")
    with pytest.raises(ValueError, match="already quantized"):
        tfm.load_any(tmp_path / "q", quantize="int4")


@linux
def test_a_quantizing_load_never_holds_the_float_weights(tmp_path):
    """Loading a bf16 folder of ~164 MB as int8 (half its bytes) in a fresh process: the peak grows
    by less than the bf16 bytes and what stays by little more than the int8 ones. Measured: peak
    +115-125 MB, held +83 MB (the int8 bytes); quantizing after a plain load (the float pages all read and kept, fp32
    copies of whole matrices): +302 / +284 MB."""
    folder = tiny_llama(tmp_path / "hf", vocab=65536, hidden=1024, layers=2)
    small = tiny_llama(tmp_path / "small", vocab=256, hidden=64, layers=1)
    script = textwrap.dedent(
        f"""
        import torch, torchformer as tfm
        from torchformer.interop import from_hf
        torch.set_num_threads(1)
        def kib(key):  # VmHWM is this process's own peak (ru_maxrss would start at the parent's)
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
        # A small quantizing load first, so that the code a load brings in (the native kernels'
        # library, setuptools for their build check: ~16 MB on CI's machine) is not counted as weights.
        tfm.load_any({str(small)!r}, quantize="int8")
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from the RSS now
        base = kib("VmRSS:")
        model = tfm.load_any({str(folder)!r}, quantize="int8")
        print(kib("VmHWM:") - base, kib("VmRSS:") - base)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    peak_mib, held_mib = (int(n) / 1024 for n in done.stdout.split()[-2:])
    bf16_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    assert bf16_mib > 150, bf16_mib
    assert peak_mib < 0.9 * bf16_mib and held_mib < 0.7 * bf16_mib, (peak_mib, held_mib, bf16_mib)
