"""A bad GGUF file is one ValueError naming what is wrong, the value and what is allowed, raised
before any weight is read (issue 29). Files are llama.cpp's converter's output, rewritten with
the gguf package's writer with one thing changed; no llama-cpp-python needed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from torchformer.interop.gguf import from_gguf, read
from torchformer.loading import model_kind

from .gguf_llamacpp import gguf_file

# One xdist worker makes the GGUF files once (a conversion takes ~15 s).
pytestmark = pytest.mark.xdist_group("gguf")


def rewrite(dst, *, meta=None, drop=(), retype=None, family="llama", extra=None):
    """The family's F32 file (llama) with metadata values replaced (meta) or added (extra: key ->
    (value, GGUFValueType, sub type or None)), tensors dropped, or one tensor stored as another
    type (retype: (name, GGMLQuantizationType) with bytes of the right size)."""
    src = gguf.GGUFReader(gguf_file(family))
    meta = meta or {}
    arch = src.fields["general.architecture"].contents()
    out = gguf.GGUFWriter(dst, meta.get("general.architecture", arch))
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        out.add_key_value(key, meta.get(key, field.contents()), field.types[0], sub_type=sub)
    for key, (value, kind, sub) in (extra or {}).items():
        out.add_key_value(key, value, kind, sub_type=sub)
    for t in src.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if retype is not None and retype[0] == t.name:
            block, size = gguf.GGML_QUANT_SIZES[retype[1]]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            out.add_tensor(t.name, raw, raw_dtype=retype[1])
        else:
            out.add_tensor(t.name, data)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return dst


@pytest.fixture
def no_reads(monkeypatch):
    """Fails the test if a weight is read (the checks come first, nothing is half-loaded)."""

    def refuse(*args):
        raise AssertionError("a weight was read before the file was checked")

    monkeypatch.setattr(read, "raw_rows", refuse)


def test_the_rewritten_file_loads(tmp_path):
    assert from_gguf(rewrite(tmp_path / "same.gguf")).config.n_layers == 2  # the helper itself is sound


def test_unsupported_architecture_names_the_supported(tmp_path, no_reads):
    path = rewrite(tmp_path / "a.gguf", meta={"general.architecture": "mamba"})
    with pytest.raises(ValueError, match=r"general.architecture='mamba' is not supported; supported: \['llama'"):
        from_gguf(path)


def test_unsupported_tensor_type_names_the_supported(tmp_path, no_reads):
    path = rewrite(tmp_path / "t.gguf", retype=("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.IQ4_NL))
    with pytest.raises(ValueError, match=r"tensor types \['IQ4_NL'\] are not supported; supported: \['F32'"):
        from_gguf(path)


def test_truncated_file(tmp_path, no_reads):
    whole = gguf_file("llama").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        from_gguf(path)
    path.write_bytes(whole[:100])  # inside the metadata
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        from_gguf(path)


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"llama.embedding_length": 128}, r"token_embd.weight is \(384, 256\), the metadata says"),
        ({"llama.block_count": 3}, r"block_count=3 but the file holds blocks 0..1"),
        ({"llama.attention.head_count_kv": 4}, r"'blk.0.attn_k.weight' has shape \(128, 256\).*implies \(256, 256\)"),
    ],
)
def test_metadata_contradicting_the_tensors(tmp_path, no_reads, meta, message):
    with pytest.raises(ValueError, match=message):
        from_gguf(rewrite(tmp_path / "m.gguf", meta=meta))


def test_a_missing_tensor_is_named(tmp_path, no_reads):
    with pytest.raises(ValueError, match=r"missing tensor 'blk.1.ffn_down.weight'"):
        from_gguf(rewrite(tmp_path / "d.gguf", drop=("blk.1.ffn_down.weight",)))


@pytest.mark.parametrize(
    "delta, message",
    [(1, "counts more tensors than the file describes|not a readable GGUF file"), (-1, "bytes follow the last tensor")],
)
def test_a_tensor_count_the_header_does_not_match(tmp_path, no_reads, delta, message):
    whole = gguf_file("llama").read_bytes()
    count = int.from_bytes(whole[8:16], "little")  # magic, version, then the tensor count (u64)
    path = tmp_path / "n.gguf"
    path.write_bytes(whole[:8] + (count + delta).to_bytes(8, "little") + whole[16:])
    with pytest.raises(ValueError, match=message):
        from_gguf(path)


def test_a_gguf_path_is_a_model_kind_and_a_missing_one_is_not(tmp_path):
    assert model_kind(gguf_file("llama")) == "gguf"
    with pytest.raises(ValueError, match=r"\.gguf file"):
        model_kind(tmp_path / "absent.gguf")


def test_olmo3_sliding_windows_are_refused_before_any_read(tmp_path, no_reads):
    extra = {"olmo2.attention.sliding_window": (4, gguf.GGUFValueType.UINT32, None)}
    path = rewrite(tmp_path / "olmo3.gguf", family="olmo2", extra=extra)
    with pytest.raises(ValueError, match=r"olmo2.attention.sliding_window is set \(OLMo 3\)"):
        from_gguf(path)


def test_gemma3_layers_follow_the_files_pattern_and_window(tmp_path):
    """llama.cpp's rules: a bool list per layer, or n (every n-th layer full), default 6; no window:
    every layer full. Each case differs from the default, so the reading is not vacuous."""
    from torchformer.interop.gguf.archs import hf_config
    from torchformer.interop.gguf.container import open_gguf

    def types(extra=None, drop_window=False):
        meta = {"gemma3.attention.sliding_window": 0} if drop_window else None
        path = rewrite(tmp_path / "g.gguf", family="gemma3", meta=meta, extra=extra)
        return ["S" if t == "sliding_attention" else "F" for t in hf_config(open_gguf(path))["layer_types"]]

    listed = [True, False, True, True, False, True]
    kind = gguf.GGUFValueType
    assert types() == list("SSSSSF")
    assert types({"gemma3.attention.sliding_window_pattern": (listed, kind.ARRAY, kind.BOOL)}) == list("SFSSFS")
    assert types({"gemma3.attention.sliding_window_pattern": (3, kind.UINT32, None)}) == list("SSFSSF")
    assert types(drop_window=True) == list("FFFFFF")


def test_an_expert_count_beyond_the_stacked_experts_is_named(tmp_path, no_reads):
    path = rewrite(tmp_path / "moe.gguf", family="qwen3moe", meta={"qwen3moe.expert_count": 5})
    stacked = r"'blk\.0\.ffn_gate_exps\.weight' has shape \(4, 128, 256\), holding no expert 4"
    with pytest.raises(ValueError, match=stacked):
        from_gguf(path)


def test_a_deepseek_v2_router_is_refused_and_split_kv_b_parts_are_checked(tmp_path, no_reads):
    """llama.cpp's deepseek2 without a gating function is V2's softmax router (our DeepSeek family
    is V3's sigmoid one); kv_b is read from its two parts, so a missing part is named as missing."""
    v2 = rewrite(tmp_path / "v2.gguf", family="deepseek2", meta={"deepseek2.expert_gating_func": 1})
    with pytest.raises(ValueError, match=r"deepseek2.expert_gating_func=1 \(softmax: DeepSeek-V2\); only 2"):
        from_gguf(v2)
    half = rewrite(tmp_path / "half.gguf", family="deepseek2", drop=("blk.1.attn_v_b.weight",))
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.attn_kv_b\.weight'"):
        from_gguf(half)
