"""The step cache (fast/step_cache.py): a later process loads a compiled decode step instead of
compiling it, without importing dynamo or inductor, and decodes the same tokens; what the package
name depends on (and what it must not: the weights' values); a package that cannot be loaded is
compiled again; a failed compile leaves nothing behind."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import torchformer as tfm
from tests.grid import build, variants
from torchformer.fast import exported, step_cache
from torchformer.fast.exported import input_slots, named_tensors, structure
from torchformer.generation.steps import decoder_step


def decoder(seed: int = 0, **changes):
    return build(next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu"), seed, n_layers=2, **changes)


def key(model, batch: int = 1) -> str | None:
    cache = model.new_cache(batch, 16)
    inputs = [torch.zeros(batch, 1, dtype=torch.long)] * 2 + [t for layer in cache.layers for t in (layer.k, layer.v)]
    shape = structure(model, named_tensors(model), input_slots(model))
    return step_cache.fingerprint(model, decoder_step, shape, inputs)


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torchformer as tfm
    from tests.grid import build, variants
    from torchformer.fast import exported
    torch.set_num_threads(1)
    model = build(next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu"), 0, n_layers=2)
    ids = torch.randint(1, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    out = tfm.generate(model, ids, max_new_tokens=8, compile=True)
    print(json.dumps({"tokens": out.tolist(), "built": exported.BUILT[0], "compiled": exported.COMPILED[0],
                      "imported": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)}))
    """
)


def test_a_later_process_loads_the_step_and_imports_no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFORMER_STEP_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "1")
    model = decoder()
    ids = torch.randint(1, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    compiled = exported.COMPILED[0]
    with torch.inference_mode(False):
        torch.set_num_threads(1)  # the child's count: part of the package's name
        first = tfm.generate(model, ids, max_new_tokens=8, compile=True)
    assert exported.COMPILED[0] == compiled + 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt2"]  # the one package, no part left
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    said = json.loads(child.stdout.strip().splitlines()[-1])
    assert said["built"] == 1 and said["compiled"] == 0  # loaded, not compiled
    assert said["imported"] == []  # neither dynamo nor inductor: an eager process's memory
    assert said["tokens"] == first.tolist() == tfm.generate(model, ids, max_new_tokens=8).tolist()


def test_the_name_follows_what_the_graph_was_traced_from(monkeypatch):
    model = decoder()
    name = key(model)
    assert name == key(decoder()) and name == key(decoder(seed=3))  # other weights: the same package
    assert key(model, batch=2) != name  # input shapes
    other = decoder()
    other.stack.final_norm.eps = 1e-3
    assert key(other) != name  # a number the forward reads
    assert key(decoder().to(torch.bfloat16)) != name  # dtypes
    monkeypatch.setenv("TORCHFORMER_NATIVE", "0")
    assert key(model) != name  # the environment's settings
    monkeypatch.delenv("TORCHFORMER_NATIVE")
    torch.set_num_threads(torch.get_num_threads() + 1)
    try:
        assert key(model) != name  # inductor writes the thread count into its kernels
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)
    assert key(model) == name
    handle = model.stack.blocks[0].register_forward_hook(lambda m, a, out: out)
    assert key(model) is None  # hooks: Python the name cannot see, never stored
    handle.remove()


def test_a_package_that_cannot_be_loaded_is_removed(tmp_path, caplog):
    bad = tmp_path / "0123.pt2"
    bad.write_bytes(b"not a package")
    assert step_cache.load(bad) is None
    assert not bad.exists()
    assert "could not be loaded" in caplog.text and "compiling it again" in caplog.text
    assert step_cache.load(tmp_path / "absent.pt2") is None


def test_a_failed_compile_leaves_nothing(tmp_path):
    def fails(name: str) -> str:
        with open(name, "wb") as f:
            f.write(b"half a package")
        raise RuntimeError("the compiler died")

    with pytest.raises(RuntimeError, match="the compiler died"):
        step_cache.store(fails, tmp_path / "steps" / "abc.pt2")
    assert list((tmp_path / "steps").iterdir()) == []


def test_the_folder_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHFORMER_STEP_CACHE", "0")
    assert step_cache.folder() is None
    monkeypatch.setenv("TORCHFORMER_STEP_CACHE", str(tmp_path))
    assert step_cache.folder() == tmp_path
    monkeypatch.delenv("TORCHFORMER_STEP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert step_cache.folder() == tmp_path / "xdg" / "torchformer" / "steps"
