"""The kernels' streamed buffers (fast/panels.py ``stream_zeros``, host_memory.huge_page_memory):
from 2 MiB up they start at a huge-page boundary in memory advised as transparent huge pages, and
the kernel backs them so once written (read back from /proc/self/smaps); a panel twin built there
multiplies bit for bit as one built in torch's memory (``TORCHFORMER_HUGE_PAGES=0``); smaller
buffers and the switch turned off take torch's own memory."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from torchformer.fast import formats
from torchformer.fast.int4_panels import Int4Panels
from torchformer.fast.int8_panels import Int8Panels
from torchformer.fast.panels import stream_zeros, streamed
from torchformer.host_memory import HUGE_PAGE

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_on = sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not thp_on, reason="needs Linux with transparent huge pages (madvise or always)")
def test_a_large_buffer_starts_at_a_huge_page_and_is_backed_by_them_once_written():
    t = stream_zeros((3 * HUGE_PAGE // 64 + 5, 16, 4), torch.uint8)  # three huge pages and a tail
    assert t.shape == (3 * HUGE_PAGE // 64 + 5, 16, 4) and t.dtype == torch.uint8
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t.fill_(7)
    assert huge_kib(t.data_ptr()) >= 3 * HUGE_PAGE // 1024  # the whole pages, not the tail's
    floats = streamed(torch.arange(HUGE_PAGE // 2, dtype=torch.float32))  # a copy in a mapping
    assert floats.data_ptr() % HUGE_PAGE == 0 and torch.equal(floats, torch.arange(HUGE_PAGE // 2).float())


def test_small_buffers_and_the_switch_turned_off_take_torchs_memory(monkeypatch):
    small = torch.ones(16)
    assert streamed(small) is small
    monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", "0")
    big = torch.ones(HUGE_PAGE)
    assert streamed(big) is big


@pytest.mark.skipif(not formats.ops_ready(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("twin,group", [(Int4Panels, 64), (Int8Panels, None)])
def test_a_twin_in_huge_pages_multiplies_as_one_in_torchs_memory(monkeypatch, twin, group):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1040, bias=True)  # panels of 2-4 MiB, a last panel of 16 rows
    x = torch.randn(3, 4096)
    fast = twin.from_linear(lin, group)
    monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", "0")
    plain = twin.from_linear(lin, group)
    if thp_on:
        assert fast.panels.data_ptr() % HUGE_PAGE == 0
    with torch.no_grad():
        assert torch.equal(fast(x), plain(x))
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), plain.state_dict().values()))


def test_loaded_bf16_weights_move_into_huge_pages_once_prepared(tmp_path, monkeypatch):
    """A bf16 checkpoint's weights are memory-mapped by the loader; ``prepare`` (every generation
    scope runs it) copies the mapped weights of its bf16 linears, small ones too, into one arena of
    huge pages: the same Parameters (the tied table's embedding reads the copy too) with the same
    values, and decoding gives the tokens of the same checkpoint loaded with the switch off."""
    import torchformer as tfm
    from torchformer.host_memory import in_file_mapping

    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=4096, d_model=512, n_layers=1, max_seq_len=64, tie_embeddings=True)
    model = tfm.build_model(cfg).bfloat16().eval()
    tfm.save(model, tmp_path / "ckpt")
    loaded = tfm.load(tmp_path / "ckpt")
    table = loaded.lm_head.weight  # tied: (4096, 512) bf16, 4 MiB
    small = loaded.stack.blocks[0].attn.q_proj.weight  # (512, 512) bf16: 0.5 MiB
    assert table is loaded.embed.tok.weight and table.dtype == torch.bfloat16
    if not in_file_mapping(table):
        pytest.skip("this loader did not memory-map the checkpoint")
    formats.prepare(loaded)
    assert loaded.lm_head.weight is table and loaded.embed.tok.weight is table
    assert loaded.stack.blocks[0].attn.q_proj.weight is small
    assert not in_file_mapping(table) and not in_file_mapping(small)
    assert torch.equal(table, model.lm_head.weight) and torch.equal(small, model.stack.blocks[0].attn.q_proj.weight)
    if thp_on:
        assert huge_kib(table.data_ptr()) >= 4 * 1024  # the arena's whole huge pages
    assert formats.stream_mapped_bf16(loaded) == 0  # nothing mapped is left: the next scope moves nothing
    monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", "0")
    plain = tfm.load(tmp_path / "ckpt")
    formats.prepare(plain)
    assert in_file_mapping(plain.lm_head.weight)  # left where the loader mapped it
    ids = torch.randint(0, 4096, (1, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(tfm.generate(loaded, ids, max_new_tokens=6), tfm.generate(plain, ids, max_new_tokens=6))


@pytest.mark.skipif(not thp_on, reason="needs Linux with transparent huge pages (madvise or always)")
def test_weights_loaded_under_inference_mode_move_as_inference_tensors(tmp_path):
    """The serving engine loads its model under inference_mode: its Parameters are inference
    tensors, and the moved copies must be too, or the tied table's embedding fails in the next
    forward ("Inference tensors do not track version counter": every request of `serve` on a tied
    bf16 folder failed so). Prepared inside a decode loop's inference_mode or outside it, the
    forward runs in both modes and equals the same checkpoint's loaded and prepared normally."""
    import torchformer as tfm
    from torchformer.host_memory import in_file_mapping

    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=4096, d_model=512, n_layers=1, max_seq_len=64, tie_embeddings=True)
    model = tfm.build_model(cfg).bfloat16().eval()
    tfm.save(model, tmp_path / "ckpt")
    ids = torch.randint(0, 4096, (1, 5), generator=torch.Generator().manual_seed(1))
    reference = tfm.load(tmp_path / "ckpt")  # normal tensors, the same kernels once prepared
    formats.prepare(reference)
    with torch.no_grad():
        want = reference(ids)
    for prepare_inside in (True, False):
        with torch.inference_mode():
            loaded = tfm.load(tmp_path / "ckpt")
        table = loaded.lm_head.weight
        if not in_file_mapping(table):
            pytest.skip("this loader did not memory-map the checkpoint")
        assert table.is_inference()
        with torch.inference_mode(prepare_inside):
            formats.prepare(loaded)
        assert not in_file_mapping(table) and table.is_inference() and loaded.embed.tok.weight is table
        with torch.inference_mode():
            assert torch.equal(loaded(ids), want)
        with torch.no_grad():
            assert torch.equal(loaded(ids), want)


def small_panel_model(layers: int = 3):
    """A Llama-shaped model in bf16 whose int4 projections are each under a huge page (~0.1-0.7 MiB)
    and all of them together a few: the toy shape's case."""
    import torchformer as tfm

    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny", vocab_size=1024, d_model=512, n_layers=layers, max_seq_len=64)
    cfg = cfg.replace(block=dataclasses.replace(cfg.block, d_ff=1408))
    model = tfm.build_model(cfg).bfloat16().eval()
    tfm.quantize(model, "int4", group_size=64)  # prepares: the twins, their joints, the arena
    return model


@pytest.mark.skipif(not formats.ops_ready(), reason="the CPU kernels are not built here")
@pytest.mark.skipif(not thp_on, reason="needs Linux with transparent huge pages (madvise or always)")
def test_small_panels_gather_into_huge_pages_and_decode_as_before(monkeypatch):
    """Panels of under a huge page each (the toy shape's every projection but its head) cannot have
    huge pages of their own; ``prepare`` moves them into one arena (fast/formats.py
    ``gather_panels``): each holder's panels are then backed by huge pages, a joint's members view its
    moved buffer and the joint stays current, the next scope moves nothing, and decoding gives the
    tokens of the same model built with huge pages off."""
    model = small_panel_model()
    found = formats.panel_holders(model)
    assert len(found) == 3 * 4 + 1  # per layer q/k/v and gate/up joints, o and down; the head
    backed = total = 0
    for holder, joint in found:
        panels = holder._buffers["panels"]
        assert holder.in_arena["panels"] is panels
        total += panels.nbytes
        backed += panels.nbytes if huge_kib(panels.data_ptr()) > 0 else 0
        if joint is not None:
            assert all(m.panels.data_ptr() >= panels.data_ptr() for m in joint.members)
            storage = panels.untyped_storage().data_ptr()
            assert all(m.panels.untyped_storage().data_ptr() == storage for m in joint.members)
            owner = next(o for o in model.modules() if getattr(o, "joint", None) is joint)
            assert joint.current(owner)
    assert total > 2 * HUGE_PAGE and backed >= total - HUGE_PAGE  # all but the arena's tail (4 KiB pages)
    assert formats.gather_panels(model) == 0  # the next scope's prepare moves nothing
    monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", "0")
    plain = small_panel_model()
    assert all("panels" not in getattr(h, "in_arena", {}) for h, _ in formats.panel_holders(plain))
    ids = torch.randint(0, 1024, (1, 7), generator=torch.Generator().manual_seed(1))
    for compiled in (False, True):
        want = tfm_generate(plain, ids, compiled)
        assert torch.equal(tfm_generate(model, ids, compiled), want)


def tfm_generate(model, ids, compiled: bool):
    import torchformer as tfm

    return tfm.generate(model, ids, max_new_tokens=8, compile=compiled)


@pytest.mark.skipif(not formats.ops_ready(), reason="the CPU kernels are not built here")
def test_a_panel_buffer_replaced_since_moves_again(monkeypatch):
    """What ``gather_panels`` placed stays; a buffer replaced since (a load into the module repacks)
    moves at the next call, and only it (an arena of plain tensors here: the logic on any machine)."""
    arenas = []

    def fake_arena(specs):
        arenas.append(specs)
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]

    monkeypatch.setenv("TORCHFORMER_HUGE_PAGES", "0")  # nothing gathered while building
    model = small_panel_model(layers=1)
    monkeypatch.setattr(formats, "huge_arena", fake_arena)
    first = formats.gather_panels(model)
    assert first > 0 and len(arenas) == 1
    assert formats.gather_panels(model) == 0 and len(arenas) == 1
    down = model.stack.blocks[0].mlp.down
    down.panels = down.panels.clone()
    assert formats.gather_panels(model) == down.panels.nbytes
    assert arenas[-1] == [(tuple(down.panels.shape), down.panels.dtype)] and down.in_arena["panels"] is down.panels
