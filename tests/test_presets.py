"""Presets have the published shapes: parameter counts against the papers / HF model cards.

BERT's published totals (110M bert-base, 22.7M all-MiniLM-L6-v2) include the pooler (a D x D
dense layer + bias on [CLS]) that sentence embeddings and MLM do not use; torchformer does not
build it, so the exact expected counts below are the published ones minus D*D + D.
"""

import pytest
import torch

import torchformer as tfm


def expected_params(cfg: tfm.ModelConfig) -> int:
    """Parameters written out from the architecture by hand (independent of build_model)."""
    d, V, a, b = cfg.d_model, cfg.vocab_size, cfg.attention, cfg.block
    hd, H, K, F = cfg.head_dim, a.n_heads, cfg.n_kv_heads, cfg.d_ff
    norm = d * (2 if b.norm == "layernorm" and b.norm_bias else 1)
    attn = d * hd * (H + 2 * K) + H * hd * d + (hd * (H + 2 * K) if a.bias else 0) + (d if a.o_bias else 0)
    gated = b.mlp in ("swiglu", "geglu", "geglu_tanh")
    mlp = (3 if gated else 2) * d * F + ((2 if gated else 1) * F + d if b.bias else 0)
    qk_norm = {None: 0, "head": 2 * hd, "width": (H + K) * hd}[a.qk_norm]  # Qwen3/Gemma 3, OLMo 2
    layer = attn + qk_norm + mlp + (4 if b.norm_placement == "sandwich" else 2) * norm  # Gemma 2/3: four
    positions = (cfg.max_seq_len + cfg.positions.offset) * d if isinstance(cfg.positions, tfm.Learned) else 0
    if isinstance(cfg.positions, tfm.RelativeBias):  # one (buckets, heads) table per stack (T5)
        positions = cfg.positions.num_buckets * H
    embed = V * d + positions + cfg.n_token_types * d + (norm if cfg.embed_norm else 0)
    final = norm if cfg.has_final_norm else 0
    head = (0 if cfg.tie_embeddings else V * d) + (V if cfg.final_logits_bias else 0)
    if cfg.moe is not None or cfg.mla is not None:  # expert and latent-attention decoders (issue 17)
        return embed + mixture_layers(cfg, layer, attn, mlp) + final + head
    if cfg.arch == "decoder":
        return embed + cfg.n_layers * layer + final + head
    if cfg.arch == "encoder":
        return embed + cfg.n_layers * layer + final
    tgt_embed = positions + (0 if cfg.share_embeddings else V * d) + (norm if cfg.embed_norm else 0)
    dec_layer = layer + attn + norm
    return embed + cfg.n_layers * layer + final + tgt_embed + cfg.decoder_layers * dec_layer + final + head


def mixture_layers(cfg: tfm.ModelConfig, layer: int, attn: int, mlp: int) -> int:
    """The blocks of an MoE / MLA decoder: MLA's projections and latent norms instead of q/k/v/o;
    an expert layer holds E gated experts, the router (E x D) and the shared experts instead of the
    dense MLP (layer kinds with mlp 'dense' keep it: DeepSeek's first 3 layers)."""
    d, H, F = cfg.d_model, cfg.attention.n_heads, cfg.d_ff
    if cfg.mla is not None:
        m = cfg.mla
        q = d * H * m.qk_dim if m.q_rank is None else d * m.q_rank + m.q_rank + m.q_rank * H * m.qk_dim
        kv = d * (m.kv_rank + m.rope_dim) + m.kv_rank + m.kv_rank * H * (m.nope_dim + m.v_dim)
        layer += q + kv + H * m.v_dim * d - attn
    if cfg.moe is None:
        return cfg.n_layers * layer
    e = cfg.moe
    fe = e.d_expert or F
    fs = (e.n_shared * fe if e.d_shared is None else e.d_shared) if e.n_shared else 0
    experts = e.n_experts * (3 * d * fe + d) + 3 * d * fs + (d if e.shared_gate else 0)
    mlp_of = {k.name: k.mlp for k in cfg.kinds}
    n_moe = sum(mlp_of.get(n, "inherit") != "dense" for n in cfg.layer_kinds or ("",) * cfg.n_layers)
    return cfg.n_layers * layer + n_moe * (experts - mlp)


PUBLISHED = {  # name: (exact count we must build, published figure, relative tolerance to it)
    "gpt2-small": (124_439_808, 124_439_808, 0.0),
    "llama2-7b": (6_738_415_616, 6_738_415_616, 0.0),
    "llama3-8b": (8_030_261_248, 8_030_261_248, 0.0),
    "llama3.1-8b": (8_030_261_248, 8_030_261_248, 0.0),  # Llama 3 with llama3-scaled RoPE: same weights
    "llama3.2-1b": (1_235_814_400, 1.23e9, 0.01),  # model card: 1.23B (tied embeddings)
    "bert-base": (109_482_240 - (768 * 768 + 768), 110e6, 0.02),  # published 110M incl. pooler
    "minilm-l6": (22_713_216 - (384 * 384 + 384), 22.7e6, 0.01),  # HF card 22.7M incl. pooler
    # Vaswani 2017 table 3: 65M and 213M; shared 37000-token embeddings, no final norm (post-LN).
    "vanilla-base": (63_082_496, 65e6, 0.05),
    "vanilla-big": (214_245_376, 213e6, 0.01),
    "llama-tiny": (1_049_728, 1e6, 0.1),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    exact, published, tol = PUBLISHED[name]
    cfg = tfm.presets.get(name)
    assert tfm.count_params(cfg) == exact
    assert abs(exact - published) <= tol * published


VARIANTS = {  # presets with the switches no preset sets, so the hand formula covers them too
    "bart-like": ("vanilla-base", dict(embed_norm=True, final_logits_bias=True, share_embeddings=False)),
    "untied-gqa-bias": ("llama-tiny", dict(attention={"bias": True, "out_bias": False}, block={"bias": True})),
    "pre-ln-encoder-decoder": ("vanilla-base", dict(block={"norm_placement": "pre"}, tie_embeddings=False)),
    "rmsnorm-bert": ("bert-base", dict(block={"norm": "rmsnorm"}, n_token_types=0)),
}


@pytest.mark.parametrize("name", tfm.presets.names() + list(VARIANTS))
def test_count_params_matches_built_model_and_hand_formula(name):
    cfg = tfm.presets.get(VARIANTS[name][0], **VARIANTS[name][1]) if name in VARIANTS else tfm.presets.get(name)
    with torch.device("meta"):
        model = tfm.build_model(cfg)
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    tied = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings and cfg.arch != "encoder" else 0
    shared = cfg.vocab_size * cfg.d_model if cfg.arch == "encoder_decoder" and cfg.share_embeddings else 0
    assert tfm.count_params(cfg) == every - tied - shared
    assert tfm.count_params(cfg) == expected_params(cfg)


def test_preset_shapes():
    base = tfm.presets.get("vanilla-base")
    assert (base.arch, base.d_model, base.n_layers, base.decoder_layers, base.d_ff) == (
        "encoder_decoder",
        512,
        6,
        6,
        2048,
    )
    assert (base.block.norm_placement, base.block.mlp, base.dropout, base.embed_scale) == ("post", "relu", 0.1, True)
    assert isinstance(base.positions, tfm.Sinusoidal) and base.share_embeddings and base.tie_embeddings
    big = tfm.presets.get("vanilla-big")
    assert (big.d_model, big.attention.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    gpt2 = tfm.presets.get("gpt2-small")
    assert (gpt2.block.mlp, gpt2.block.norm_placement, gpt2.max_seq_len) == ("gelu_tanh", "pre", 1024)
    assert isinstance(gpt2.positions, tfm.Learned) and gpt2.tie_embeddings
    bert = tfm.presets.get("bert-base")
    assert (bert.arch, bert.n_token_types, bert.embed_norm, bert.block.mlp, bert.max_seq_len) == (
        "encoder",
        2,
        True,
        "gelu",
        512,
    )
    l2 = tfm.presets.get("llama2-7b")
    assert (l2.d_ff, l2.block.norm, l2.block.norm_eps, l2.tie_embeddings) == (11008, "rmsnorm", 1e-5, False)
    assert l2.positions == tfm.RoPE(base=10000.0, pairing="half")
    l3 = tfm.presets.get("llama3-8b")
    assert (l3.n_kv_heads, l3.d_ff, l3.vocab_size, l3.positions.base) == (8, 14336, 128256, 500000.0)
    tiny = tfm.presets.get("llama-tiny")
    assert tiny.n_kv_heads < tiny.attention.n_heads  # GQA


def test_get_with_changes_and_unknown_name():
    cfg = tfm.presets.get("llama-tiny", n_layers=2, attention={"backend": "math"})
    assert cfg.n_layers == 2 and cfg.attention.backend == "math" and cfg.attention.n_kv_heads == 2
    with pytest.raises(ValueError, match="unknown preset 'gpt5'.*llama-tiny"):
        tfm.presets.get("gpt5")


def test_every_preset_builds_and_runs_small():
    """Each preset family's wiring runs a forward (shrunk to 1 layer, small vocab, for speed)."""
    for name in tfm.presets.names():
        cfg = tfm.presets.get(name)
        small = cfg.replace(
            vocab_size=64,
            d_model=64,
            n_layers=1,
            layer_kinds=None if cfg.layer_kinds is None else cfg.layer_kinds[:1],  # layer 0's kind
            max_seq_len=32,
            attention={"n_heads": 4, "n_kv_heads": None},
            **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")),
        )
        if small.arch == "encoder_decoder":
            small = small.replace(n_decoder_layers=1)
        model = tfm.build_model(small).eval()
        ids = torch.randint(0, 64, (2, 8))
        out = model(ids, ids) if small.arch == "encoder_decoder" else model(ids)
        assert out.shape[:2] == (2, 8) and torch.isfinite(out).all()


def test_meta_device_counting_and_loading_stay_cheap(tmp_path):
    """Meta-device builds (count_params, load) must not fill tensors: normal_/arange on meta go
    through torch._refs and import torch._dynamo, which costs ~5 s in a fresh process."""
    import subprocess
    import sys

    tfm.save(tfm.build_model(tfm.presets.get("llama-tiny", n_layers=1)), tmp_path / "m")
    code = (
        "import sys, torchformer as tfm\n"
        "[tfm.count_params(tfm.presets.get(n)) for n in tfm.presets.names()]\n"
        f"tfm.load({str(tmp_path / 'm')!r})\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
