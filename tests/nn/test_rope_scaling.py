"""Scaled RoPE and partial rotary (issue 14, part A), without checkpoints:

- each scheme's inverse frequencies and attention factor equal transformers'
  ROPE_INIT_FUNCTIONS for several settings (and dynamic's at several lengths);
- the tables build.py makes give HF's rotary-embedding cos/sin for the same config, on both
  sides of the original length for dynamic and longrope;
- partial rotary equals GPT-NeoX's apply_rotary_pos_emb, and interleaved partial rotary with
  permuted rows equals half partial rotary;
- static schemes keep RoPE's relative-offset property; cached decoding equals the full forward;
  compiled decode compiles once;
- configs round-trip through JSON and bad values are named.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as T
from torch._dynamo.utils import counters
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

import torchformer as tfm
from torchformer.configs import SCALING_KINDS, DynamicNTK, LinearScaling, Llama3Scaling, LongRoPE, RoPE, YaRN
from torchformer.models.build import rotary
from torchformer.nn import rope_scaling as rs


def hf_config(head_dim: int, max_len: int, params: dict, fraction: float = 1.0) -> T.LlamaConfig:
    return T.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_len,
        rope_parameters={"rope_theta": params.pop("rope_theta", 10000.0), **params, "partial_rotary_factor": fraction},
    )


def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Our float64 frequencies against HF's float32 ones: equal to float32 rounding."""
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-6, atol=0)


# (head_dim, fraction, base): the widths the settings below run at
WIDTHS = [(16, 1.0, 10000.0), (64, 1.0, 500000.0), (128, 0.75, 10000.0), (64, 0.25, 1e6)]


@pytest.mark.parametrize("head_dim, fraction, base", WIDTHS)
@pytest.mark.parametrize("factor", [1.0, 2.5, 8.0])
def test_linear_inv_freq_equals_hf(head_dim, fraction, base, factor):
    dim = int(head_dim * fraction)
    hf = hf_config(head_dim, 64, dict(rope_type="linear", factor=factor, rope_theta=base), fraction)
    inv, attn = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    same(rs.linear_inv_freq(dim, base, factor), inv)
    assert attn == 1.0


LLAMA3 = [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 2.0, 8.0, 64), (16.0, 0.5, 3.0, 1024)]


@pytest.mark.parametrize("head_dim, fraction, base", WIDTHS)
@pytest.mark.parametrize("factor, low, high, original", LLAMA3)
def test_llama3_inv_freq_equals_hf(head_dim, fraction, base, factor, low, high, original):
    dim = int(head_dim * fraction)
    params = dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
        rope_theta=base,
    )
    inv, attn = ROPE_INIT_FUNCTIONS["llama3"](hf_config(head_dim, 8 * original, params, fraction), "cpu")
    ours = rs.llama3_inv_freq(dim, base, factor, low, high, original)
    same(ours, inv)
    assert attn == 1.0
    # The three bands are all present for the published setting, so every branch is compared.
    if (factor, head_dim) == (32.0, 64):
        plain = rs.default_inv_freq(dim, base)
        ratio = plain / ours
        assert (ratio == 1).any() and (ratio == factor).any() and ((ratio > 1) & (ratio < factor)).any()


YARNS = [
    dict(factor=4.0, original=16),
    dict(factor=4.0, original=4096, beta_fast=16.0, beta_slow=2.0),
    dict(factor=40.0, original=4096, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-style
    dict(factor=8.0, original=2048, truncate=False),
    dict(factor=2.0, original=32, attention_factor=1.5),
    dict(factor=None, original=16),  # factor from max_position_embeddings / original
]


@pytest.mark.parametrize("head_dim, fraction, base", WIDTHS)
@pytest.mark.parametrize("setting", YARNS, ids=[str(i) for i in range(len(YARNS))])
def test_yarn_inv_freq_and_attention_factor_equal_hf(head_dim, fraction, base, setting):
    s = dict(setting)
    original = s.pop("original")
    max_len = 4 * original
    params = dict(rope_type="yarn", original_max_position_embeddings=original, rope_theta=base, **s)
    inv, attn = ROPE_INIT_FUNCTIONS["yarn"](hf_config(head_dim, max_len, params, fraction), "cpu")
    scaling = YaRN(original_max_seq_len=original, **s)
    factor = scaling.resolved_factor(max_len)
    dim = int(head_dim * fraction)
    ours = rs.yarn_inv_freq(dim, base, factor, original, scaling.beta_fast, scaling.beta_slow, scaling.truncate)
    same(ours, inv)
    assert rs.yarn_attention_factor(factor, scaling.attention_factor, scaling.mscale, scaling.mscale_all_dim) == (
        pytest.approx(attn, rel=1e-12)
    )


def factors(n: int, top: float) -> list[float]:
    return [1.0 + (top - 1.0) * i / max(n - 1, 1) for i in range(n)]


LONGROPES = [
    dict(original=16, max_len=64),
    dict(original=4096, max_len=131072),  # Phi-3-mini-128k's lengths: factor 32
    dict(original=4096, max_len=4096),  # factor 1: attention factor 1
    dict(original=32, max_len=64, factor=3.0, attention_factor=1.2),
]


@pytest.mark.parametrize("head_dim, fraction, base", WIDTHS)
@pytest.mark.parametrize("setting", LONGROPES, ids=[str(i) for i in range(len(LONGROPES))])
def test_longrope_inv_freq_and_attention_factor_equal_hf(head_dim, fraction, base, setting):
    s = dict(setting)
    original, max_len = s.pop("original"), s.pop("max_len")
    dim = int(head_dim * fraction)
    short, long = factors(dim // 2, 1.5), factors(dim // 2, 40.0)
    params = dict(
        rope_type="longrope",
        short_factor=short,
        long_factor=long,
        original_max_position_embeddings=original,
        rope_theta=base,
        **s,
    )
    hf = hf_config(head_dim, max_len, params, fraction)
    scaling = LongRoPE(short_factor=short, long_factor=long, original_max_seq_len=original, **s)
    factor = rs.longrope_attention_factor(scaling.resolved_factor(max_len), original, scaling.attention_factor)
    for seq_len, ours in ((None, short), (original + 1, long)):
        inv, attn = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        same(rs.longrope_inv_freq(dim, base, tuple(ours)), inv)
        assert factor == pytest.approx(attn, rel=1e-12)


@pytest.mark.parametrize("head_dim, fraction, base", WIDTHS)
@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_dynamic_inv_freq_equals_hf_at_every_length(head_dim, fraction, base, factor):
    original, dim = 64, int(head_dim * fraction)
    hf = hf_config(head_dim, original, dict(rope_type="dynamic", factor=factor, rope_theta=base), fraction)
    for length in (1, 63, 64, 65, 100, 1000, 100000):
        inv, attn = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(length))
        ours = rs.dynamic_inv_freq(dim, base, factor, original, torch.tensor(length))
        torch.testing.assert_close(ours, inv, rtol=1e-5, atol=0)  # both fp32 (HF's rounding path differs)
        assert attn == 1.0


# -- the tables build.py makes == HF's rotary embedding module -----------------------------------

ORIGINAL = 16
SCHEMES = {  # name -> (our scaling, HF rope_parameters, max_position_embeddings)
    "linear": (LinearScaling(factor=3.0), dict(rope_type="linear", factor=3.0), 64),
    "llama3": (
        Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=ORIGINAL),
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
        64,
    ),
    "yarn": (YaRN(factor=4.0, original_max_seq_len=ORIGINAL), dict(rope_type="yarn", factor=4.0), 64),
    "longrope": (
        LongRoPE(short_factor=factors(8, 2.0), long_factor=factors(8, 9.0), original_max_seq_len=ORIGINAL),
        dict(rope_type="longrope", short_factor=factors(8, 2.0), long_factor=factors(8, 9.0)),
        64,
    ),
    "dynamic": (DynamicNTK(factor=4.0, original_max_seq_len=ORIGINAL), dict(rope_type="dynamic", factor=4.0), ORIGINAL),
}


def model_config(scaling, max_len: int, *, d_model: int = 64, **rope) -> tfm.ModelConfig:
    return tfm.presets.get(
        "llama-tiny",
        d_model=d_model,
        n_layers=2,
        max_seq_len=max_len,
        attention={"n_heads": 4, "n_kv_heads": 2},
        positions=RoPE(scaling=scaling, **rope),
    )


@pytest.mark.parametrize("name", sorted(SCHEMES))
@torch.no_grad()
def test_tables_give_hf_cos_sin_on_both_sides_of_the_original_length(name):
    scaling, params, hf_max = SCHEMES[name]
    if name in ("llama3", "yarn", "longrope"):
        params = dict(params, original_max_position_embeddings=ORIGINAL)
    cfg = model_config(scaling, 64)
    table, _ = rotary(cfg)
    hf = T.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config(16, hf_max, dict(params)))
    x = torch.zeros(1)
    for length in (10, ORIGINAL, ORIGINAL + 1, 64):  # one row short of the longest: max decides
        pos = torch.stack([torch.arange(length), torch.arange(length).clamp(max=length - 2)])  # (2, T)
        cos, sin = table(pos)
        want_cos, want_sin = hf(x, pos)  # (B, T, E): the E/2 angles twice
        # HF forms angles in fp32 (error ~ position * 6e-8); our static tables in fp64.
        torch.testing.assert_close(cos[:, 0], want_cos[..., :8], rtol=0, atol=1e-5)
        torch.testing.assert_close(sin[:, 0], want_sin[..., :8], rtol=0, atol=1e-5)


# -- partial rotary ---------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("name", ["plain", "yarn", "longrope"])
@torch.no_grad()
def test_partial_rotary_equals_gpt_neox(fraction, name):
    """Our (table, rotation) at rotary width int(fraction * E) == GPT-NeoX's rotary embedding and
    apply_rotary_pos_emb (which rotate the first rotary_dim features, half-split, pass the rest)."""
    head_dim, dim = 32, int(32 * fraction)
    scaling = {
        "plain": None,
        "yarn": YaRN(factor=4.0, original_max_seq_len=ORIGINAL),
        "longrope": LongRoPE(
            short_factor=factors(dim // 2, 2.0), long_factor=factors(dim // 2, 9.0), original_max_seq_len=ORIGINAL
        ),
    }[name]
    params = {"plain": dict(rope_type="default"), "yarn": dict(rope_type="yarn", factor=4.0)}.get(name)
    if name == "longrope":
        params = dict(rope_type="longrope", short_factor=factors(dim // 2, 2.0), long_factor=factors(dim // 2, 9.0))
    if name != "plain":
        params["original_max_position_embeddings"] = ORIGINAL
    neox = T.GPTNeoXConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_theta": 10000.0, **params, "partial_rotary_factor": fraction},
    )
    cfg = model_config(scaling, 64, d_model=4 * head_dim, fraction=fraction)
    table, rotate = rotary(cfg)
    q = torch.randn(2, 4, 40, head_dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None].expand(2, -1)
    cos, sin = GPTNeoXRotaryEmbedding(neox)(q, pos)
    assert cos.shape[-1] == dim
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = rotate(q, *table(pos))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got[..., dim:], q[..., dim:])


def permute_rotary_rows(w: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Interleaved -> half pairing of the first ``dim`` rows of each of n heads (the rest kept):
    rows (0, 1, 2, 3, ...) of the rotated part become (0, 2, ..., 1, 3, ...)."""
    heads = w.reshape(n, -1, *w.shape[1:])  # (n, E, ...)
    rot = heads[:, :dim].reshape(n, dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(n, dim, *w.shape[1:])
    return torch.cat([rot, heads[:, dim:]], 1).reshape(w.shape)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("name", ["plain", "llama3", "longrope"])
@torch.no_grad()
def test_interleaved_partial_rotary_with_permuted_rows_equals_half(fraction, name):
    scaling = None if name == "plain" else narrowed(SCHEMES[name][0], fraction)
    inter = tfm.build_model(model_config(scaling, 64, pairing="interleaved", fraction=fraction)).eval()
    half = tfm.build_model(model_config(scaling, 64, pairing="half", fraction=fraction)).eval()
    dim, heads = int(16 * fraction), {"q_proj": 4, "k_proj": 2}
    state = {}
    for key, tensor in inter.state_dict().items():
        proj = key.split(".")[-2]
        if proj in heads:
            tensor = tensor.normal_(std=0.3)  # sharp scores, so a wrong pairing shows
            state[key] = permute_rotary_rows(tensor, heads[proj], dim)
        else:
            state[key] = tensor
    half.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 40))
    assert (half(ids) - inter(ids)).abs().max() < 1e-5
    assert (half(ids) - tfm.build_model(half.config.replace(positions=RoPE())).eval()(ids)).abs().max() > 1e-3


# -- model-level properties ---------------------------------------------------------------------

STATIC = {
    "linear": LinearScaling(factor=3.0),
    "llama3": SCHEMES["llama3"][0],
    "yarn": YaRN(factor=None, original_max_seq_len=ORIGINAL, mscale=1.0, mscale_all_dim=0.5),
}


def narrowed(scaling, fraction: float):
    """LongRoPE lists sized for the rotated width of a 16-wide head at ``fraction``."""
    if not isinstance(scaling, LongRoPE):
        return scaling
    n = int(16 * fraction) // 2
    return LongRoPE(short_factor=factors(n, 2.0), long_factor=factors(n, 9.0), original_max_seq_len=ORIGINAL)


def sharp(cfg: tfm.ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.data.normal_(std=0.3)
    return model


@pytest.mark.parametrize("name", sorted(STATIC))
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@torch.no_grad()
def test_static_schemes_depend_only_on_offsets(name, fraction):
    model = sharp(model_config(STATIC[name], 64, pairing="interleaved", fraction=fraction))
    ids = torch.randint(0, 256, (2, 20))
    pos = torch.arange(20)[None]
    base = model(ids, positions=pos)
    assert (model(ids, positions=pos + 37) - base).abs().max() < 1e-4
    # Control: positions that change the offsets change the logits, so the shift above was seen.
    assert (model(ids, positions=pos * 2) - base).abs().max() > 1e-2  # 100x the tolerance above


CACHED = {  # name -> (scaling, prompt length, total length): lengths on one side of ORIGINAL
    **{f"{k}": (v, 6, 40) for k, v in STATIC.items()},
    "longrope-short": (SCHEMES["longrope"][0], 4, ORIGINAL),
    "longrope-long": (SCHEMES["longrope"][0], ORIGINAL + 1, 40),
    "dynamic-short": (SCHEMES["dynamic"][0], 4, ORIGINAL),
}


@pytest.mark.parametrize("name", sorted(CACHED))
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(name, fraction):
    """Prefill, then one token at a time: every step's logits equal the full forward's at that
    position. (Dynamic and longrope across ORIGINAL: see the HF cached-step test in interop.)"""
    scaling, prompt, total = CACHED[name]
    model = sharp(model_config(narrowed(scaling, fraction), 64, fraction=fraction))
    ids = torch.randint(0, 256, (2, total), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = model.new_cache(2, total)
    pos = torch.arange(total)[None].expand(2, -1)
    steps = [model(ids[:, :prompt], positions=pos[:, :prompt], cache=cache)]
    steps += [model(ids[:, t : t + 1], positions=pos[:, t : t + 1], cache=cache) for t in range(prompt, total)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["yarn-partial", "longrope", "dynamic"])
def test_compiled_decode_compiles_once_and_matches_eager(name, aot_eager):
    """Through dynamo and AOT autograd (tests/conftest.py's aot_eager: graph capture, guards and the
    traced formulation are what the scheme changes; inductor's kernels: generation/test_compile.py)."""
    cfg = {
        "yarn-partial": model_config(STATIC["yarn"], 64, fraction=0.5),
        "longrope": model_config(SCHEMES["longrope"][0], 64),
        "dynamic": model_config(SCHEMES["dynamic"][0], 64),
    }[name]
    model = sharp(cfg.replace(n_layers=1))
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch._dynamo.reset()
    counters.clear()
    compiled = tfm.generate(model, ids, attention_mask=mask, max_new_tokens=21, compile=True)  # crosses 16
    assert counters["stats"]["unique_graphs"] == 1 and len(aot_eager) == 1
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(compiled, tfm.generate(model, ids, attention_mask=mask, max_new_tokens=21))


# -- configs ------------------------------------------------------------------------------------

EVERY = {**{k: v[0] for k, v in SCHEMES.items()}, "yarn-full": STATIC["yarn"]}


@pytest.mark.parametrize("name", sorted(EVERY))
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_json_round_trip_keeps_the_scheme(name, fraction):
    cfg = model_config(narrowed(EVERY[name], fraction), 64, fraction=fraction)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["positions"]["scaling"]["kind"] in SCALING_KINDS
    assert tfm.ModelConfig.from_dict(d) == cfg


def test_plain_rope_configs_saved_before_scaling_existed_still_load():
    d = model_config(None, 64).to_dict()
    del d["positions"]["fraction"], d["positions"]["scaling"]
    assert tfm.ModelConfig.from_dict(d).positions == RoPE()


BAD = {
    "linear factor": (lambda: LinearScaling(factor=0.0), "positions.scaling.factor=0.0: must be > 0"),
    "linear factor type": (lambda: LinearScaling(factor="2"), "positions.scaling.factor='2': must be a number"),
    "llama3 bands": (
        lambda: Llama3Scaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=2.0),
        "positions.scaling.high_freq_factor=2.0: must be > low_freq_factor=4.0",
    ),
    "yarn beta": (lambda: YaRN(factor=2.0, original_max_seq_len=16, beta_slow=0.0), "beta_slow=0.0: must be > 0"),
    "yarn original": (lambda: YaRN(factor=2.0, original_max_seq_len=0), "original_max_seq_len=0: must be > 0"),
    "dynamic original type": (
        lambda: DynamicNTK(factor=2.0, original_max_seq_len=16.5),
        "original_max_seq_len=16.5: must be an integer",
    ),
    "longrope numbers": (
        lambda: LongRoPE(short_factor=[1.0, "2"], long_factor=[1.0, 2.0], original_max_seq_len=16),
        "positions.scaling.short_factor=[1.0, '2']: must be a list of numbers > 0",
    ),
    "longrope negative": (
        lambda: LongRoPE(short_factor=[1.0, 2.0], long_factor=[1.0, -2.0], original_max_seq_len=16),
        "positions.scaling.long_factor=(1.0, -2.0): must be a list of numbers > 0",
    ),
    "longrope length": (
        lambda: model_config(LongRoPE(short_factor=[1.0] * 8, long_factor=[1.0] * 7, original_max_seq_len=16), 64),
        "positions.scaling.long_factor='<7 numbers>': needs 8 (rotated features / 2)",
    ),
    "longrope length partial": (
        lambda: model_config(
            LongRoPE(short_factor=[1.0] * 8, long_factor=[1.0] * 8, original_max_seq_len=16), 64, fraction=0.5
        ),
        "positions.scaling.short_factor='<8 numbers>': needs 4",
    ),
    "fraction range": (lambda: RoPE(fraction=1.5), "positions.fraction=1.5: must be in (0, 1]"),
    "fraction odd width": (
        lambda: model_config(None, 64, fraction=0.2),
        "positions.fraction=0.2: int(fraction * head_dim=16) = 3 rotated features",
    ),
    "fraction too small": (lambda: model_config(None, 64, fraction=0.1), "= 1 rotated features: must be even and >= 2"),
    "dynamic width": (
        lambda: model_config(DynamicNTK(factor=2.0, original_max_seq_len=16), 64, fraction=0.125),
        "needs more than 2 rotated features, got 2",
    ),
    "scaling type": (
        lambda: RoPE(scaling={"kind": "yarn"}),
        "positions.scaling={'kind': 'yarn'}: must be None or one of",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_named(case):
    make, message = BAD[case]
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(kind="ntk"), "positions.scaling.kind='ntk': must be one of ['linear', 'dynamic'"),
        (lambda s: s.update(theta=2.0), "unknown key(s) in positions.scaling: ['theta']"),
        (lambda s: s.pop("kind"), "positions.scaling.kind=None"),
    ],
)
def test_bad_scaling_json_is_named(edit, message):
    d = model_config(LinearScaling(factor=2.0), 64).to_dict()
    edit(d["positions"]["scaling"])
    with pytest.raises(ValueError) as err:
        tfm.ModelConfig.from_dict(d)
    assert message in str(err.value)


def test_the_yarn_default_attention_factor_is_the_papers():
    # sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22), written out here independently.
    assert rs.yarn_attention_factor(16.0, None, None, None) == pytest.approx(0.1 * math.log(16.0) + 1)
    assert rs.yarn_attention_factor(0.5, None, None, None) == 1.0


@pytest.mark.parametrize("name", sorted(EVERY))
def test_verify_passes_with_the_relative_offset_check_run(name):
    """verify's shift check runs below the original length for dynamic / longrope, whose
    frequencies follow the length (a shift across it would change them, by design)."""
    fraction = 0.5 if name == "yarn-full" else 1.0
    report = tfm.verify(sharp(model_config(narrowed(EVERY[name], fraction), 64, fraction=fraction)))
    assert not [row for row in report.rows if row.failed]
    (relative,) = [row for row in report.rows if row.check == "relative positions"]
    assert relative.status == "pass"
