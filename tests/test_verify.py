"""verify: passes on every preset (large ones scaled down), fails each classic fault with a
message naming it, works for all three archs; the CLI exits 1 on a failure."""

import pytest
import torch

import torchformer as tfm
import torchformer.models.stack as stack_module
from tests.grid import build, variant_id, variants
from torchformer.cli.main import main
from torchformer.nn.attention import Attention
from torchformer.verify import shrink_config, verify

BUDGET = 3e8  # FLOPs per fp16/bf16 forward: keeps each verify to a few seconds on 2 cores


def preset_model(name: str) -> torch.nn.Module:
    cfg = tfm.presets.get(name)
    if tfm.count_params(cfg) > 2_000_000:
        cfg = shrink_config(cfg)
    torch.manual_seed(0)
    return tfm.build_model(cfg)


@pytest.mark.parametrize("name", tfm.presets.names())
def test_verify_passes_on_every_preset(name):
    report = verify(preset_model(name), untrained=True, flop_budget=BUDGET)
    assert report.ok, report.table()
    statuses = {r.check: r.status for r in report.rows}
    assert statuses["masked keys zero weight"] == "pass"
    assert statuses["initial loss ~ ln(V)"] == "pass"
    expected_na = {"cached == uncached"} if tfm.presets.get(name).arch == "encoder" else set()
    if not isinstance(tfm.presets.get(name).positions, tfm.RoPE | tfm.ALiBi | tfm.RelativeBias):
        expected_na.add("relative positions")
    assert {c for c, s in statuses.items() if s == "n/a"} == expected_na


# Grid rows that add what the presets lack: ALiBi, relative bias, interleaved RoPE, no positions,
# MQA, the math backend; sharp q/k weights so a wrong mask or rotation moves outputs visibly.
GRID = [v for v in variants() if v["position"] in ("alibi", "relative_bias", "rope-interleaved", "none")][:6]


@pytest.mark.parametrize("v", GRID, ids=[variant_id(v) for v in GRID])
def test_verify_passes_on_grid_variants(v):
    report = verify(build(v), untrained=False, flop_budget=BUDGET / 10)
    assert report.ok, report.table()


def test_verify_passes_with_a_sliding_window():
    cfg = shrink_config(tfm.presets.get("llama3-8b")).replace(attention={"sliding_window": 5}, max_seq_len=64)
    assert verify(tfm.build_model(cfg), flop_budget=BUDGET).ok


# ---- the three classic faults -------------------------------------------------------------------


def off_by_one_up(q_pos, k_pos):  # the causal rule of nn/patterns.py, shifted
    return lambda b, h, q, kv: k_pos[b, kv] <= q_pos[b, q] + 1  # query i also sees key i + 1


def off_by_one_down(q_pos, k_pos):
    return lambda b, h, q, kv: k_pos[b, kv] < q_pos[b, q]  # query i cannot see itself


def no_upcast(q, k, v, *, mask=None, bias=None, is_causal=False, scale, dropout_p=0.0, **_):
    """Attention entirely in the input dtype: fp16 scores overflow, softmax sees inf."""
    T, S, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(q.dtype)
    if is_causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
    weights = scores.softmax(-1)
    return (weights * mask if mask is not None else weights) @ v


def broken(name: str, fault: str, monkeypatch) -> torch.nn.Module:
    model = preset_model(name)
    if fault == "mask_up":
        monkeypatch.setattr(stack_module, "causal", off_by_one_up)
    if fault == "mask_down":
        monkeypatch.setattr(stack_module, "causal", off_by_one_down)
    for m in model.modules():
        if isinstance(m, Attention) and fault == "no_scale":
            m.scale = 1.0
        if isinstance(m, Attention) and fault == "fp16_softmax":
            m.backend = no_upcast
    return model


FAULTS = {
    "mask_up": ("masked keys zero weight", "diagonal off by one: query i sees key i+1"),
    "mask_down": ("masked keys zero weight", "diagonal off by one: query i cannot see key i"),
    "no_scale": ("score scale", "1/sqrt(d_k) scaling is missing"),
    "fp16_softmax": ("fp16/bf16 attention", "without an fp32 upcast"),
}


@pytest.mark.parametrize("name", ["llama-tiny", "vanilla-base"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_verify_fails_each_broken_variant_naming_the_fault(name, fault, monkeypatch):
    report = verify(broken(name, fault, monkeypatch), untrained=True, flop_budget=BUDGET / 10)
    check, words = FAULTS[fault]
    assert not report.ok
    row = report.row(check)
    assert row.status == "fail" and words in row.message, report.table()
    if fault == "mask_up":  # the perturbation test sees it too, on the explicit-mask path
        assert report.row("causality").status == "fail"
        assert "causal mask diagonal off by one" in report.row("causality").message


def test_verify_fails_an_encoder_that_masks_the_future(monkeypatch):
    model = preset_model("minilm-l6")
    model.stack.causal = True
    report = verify(model, flop_budget=BUDGET / 10)
    assert report.row("bidirectional").status == "fail"
    assert "causal mask" in report.row("bidirectional").message


def test_verify_restores_mode_and_backends_and_rejects_bad_input():
    model = preset_model("llama-tiny").train()
    backends = [m.backend for m in model.modules() if isinstance(m, Attention)]
    verify(model, flop_budget=BUDGET / 10)
    assert model.training
    assert [m.backend for m in model.modules() if isinstance(m, Attention)] == backends
    with pytest.raises(TypeError, match="torchformer model"):
        verify(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="seq_len=2"):
        verify(model, seq_len=2)


def test_a_check_that_raises_becomes_a_failing_row():
    model = preset_model("llama-tiny")

    def broken_cache(*args, **kwargs):
        raise RuntimeError("cache exploded")

    model.new_cache = broken_cache
    report = verify(model, flop_budget=BUDGET / 10)
    row = report.row("cached == uncached")
    assert row.status == "fail" and "RuntimeError: cache exploded" in row.message
    assert report.row("causality").status == "pass"  # the other checks still ran


def test_untrained_is_inferred_from_the_weights():
    model = preset_model("llama-tiny")
    assert verify(model, flop_budget=BUDGET / 10).row("initial loss ~ ln(V)").status == "pass"
    with torch.no_grad():
        model.stack.final_norm.weight.add_(0.1)  # as after training
    assert verify(model, flop_budget=BUDGET / 10).row("initial loss ~ ln(V)").status == "n/a"


def test_shrink_keeps_the_variant():
    big = tfm.presets.get("llama3-8b")
    small = shrink_config(big)
    assert small.attention.n_heads // small.n_kv_heads == 4 == big.attention.n_heads // big.n_kv_heads
    assert (small.arch, small.block.norm, small.block.mlp, small.positions) == (
        big.arch,
        big.block.norm,
        big.block.mlp,
        big.positions,
    )
    assert small.d_ff / small.d_model == pytest.approx(big.d_ff / big.d_model, rel=0.02)
    assert tfm.count_params(small) < 200_000


# ---- the command line ---------------------------------------------------------------------------


def test_cli_verify_scaled_down_preset_passes(capsys):
    assert main(["verify", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "scaled-down model of the same variant" in out and "all checks passed" in out
    assert "causality" in out and "PASS" in out


def test_cli_verify_exits_1_on_a_failure(tmp_path, monkeypatch, capsys):
    model = preset_model("llama-tiny")
    tfm.save(model, tmp_path / "ckpt")
    monkeypatch.setattr(stack_module, "causal", off_by_one_up)
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "diagonal off by one" in out


def test_cli_verify_unknown_model_is_a_clean_error(capsys):
    assert main(["verify", "no-such-model"]) == 2
    assert "neither a folder" in capsys.readouterr().err


def test_cli_verify_an_hf_folder_of_each_shape(tmp_path, capsys):
    from torchformer.interop import to_hf

    bart = shrink_config(tfm.presets.get("vanilla-base")).replace(
        positions=tfm.Learned(offset=2),
        embed_norm=True,
        embed_scale=False,
        final_logits_bias=True,
        block={"mlp": "gelu"},
    )
    models = {
        "llama-tiny": preset_model("llama-tiny"),
        "minilm-l6": preset_model("minilm-l6"),
        "bart": tfm.build_model(bart),
    }
    for name, model in models.items():
        to_hf(model, tmp_path / name)
        assert main(["verify", str(tmp_path / name)]) == 0, capsys.readouterr().out
        assert "all checks passed" in capsys.readouterr().out
