"""Named model shapes as data. ``get(name)`` returns a ModelConfig; ``names()`` lists them.

Shapes follow the published models exactly; tests check parameter counts against the published
figures (gpt2-small 124,439,808; llama2-7b 6,738,415,616).
"""

from __future__ import annotations

from .configs import (
    AttentionConfig,
    BlockConfig,
    LayerKind,
    Learned,
    Llama3Scaling,
    ModelConfig,
    RelativeBias,
    RoPE,
    Sinusoidal,
    layer_pattern,
)
from .moe_presets import MOE_PRESETS


def _vanilla(d_model: int, n_heads: int, d_ff: int, dropout: float) -> ModelConfig:
    # Vaswani et al. 2017, table 3: post-LN, sinusoidal positions, ReLU FFN, shared
    # source/target/output embeddings (section 3.4) over a 37000-token BPE vocabulary.
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=37000,
        d_model=d_model,
        n_layers=6,
        n_decoder_layers=6,
        max_seq_len=1024,
        attention=AttentionConfig(n_heads=n_heads, bias=True, dropout=0.0),
        block=BlockConfig(norm="layernorm", norm_placement="post", mlp="relu", d_ff=d_ff, bias=True, dropout=dropout),
        positions=Sinusoidal(),
        embed_scale=True,
        tie_embeddings=True,
        share_embeddings=True,
        dropout=dropout,
        init="xavier",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )


def _llama(
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv: int,
    d_ff: int | None,
    base: float,
    max_len: int,
    eps: float = 1e-5,
    *,
    scaling: Llama3Scaling | None = None,
    tie: bool = False,
    ids: tuple[int, int] | None = None,
) -> ModelConfig:
    bos, eos = (None, None) if ids is None else ids
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        max_seq_len=max_len,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv),
        block=BlockConfig(norm="rmsnorm", norm_eps=eps, norm_placement="pre", mlp="swiglu", d_ff=d_ff),
        positions=RoPE(base=base, pairing="half", scaling=scaling),
        tie_embeddings=tie,
        bos_token_id=bos,
        eos_token_id=eos,
    )


def _bert(vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int) -> ModelConfig:
    return ModelConfig(
        arch="encoder",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        max_seq_len=512,
        attention=AttentionConfig(n_heads=n_heads, bias=True),
        block=BlockConfig(
            norm="layernorm", norm_eps=1e-12, norm_placement="post", mlp="gelu", d_ff=d_ff, bias=True, dropout=0.1
        ),
        positions=Learned(),
        n_token_types=2,
        embed_norm=True,
        dropout=0.1,
        pad_token_id=0,
    )


def _t5(d_model: int, n_layers: int, n_heads: int, d_ff: int, mlp: str, *, tied: bool) -> ModelConfig:
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=32128,
        d_model=d_model,
        n_layers=n_layers,
        n_decoder_layers=n_layers,
        max_seq_len=512,
        attention=AttentionConfig(n_heads=n_heads, head_dim=64, scale=1.0, dropout=0.1),
        block=BlockConfig(norm="rmsnorm", norm_eps=1e-6, norm_placement="pre", mlp=mlp, d_ff=d_ff, dropout=0.1),
        positions=RelativeBias(num_buckets=32, max_distance=128),
        tie_embeddings=tied,
        head_scale=d_model**-0.5 if tied else None,
        dropout=0.1,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _llama31_rope(factor: float) -> Llama3Scaling:
    return Llama3Scaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)


_PRESETS = {
    "vanilla-base": lambda: _vanilla(512, 8, 2048, 0.1),
    "vanilla-big": lambda: _vanilla(1024, 16, 4096, 0.3),
    "gpt2-small": lambda: ModelConfig(
        arch="decoder",
        vocab_size=50257,
        d_model=768,
        n_layers=12,
        max_seq_len=1024,
        attention=AttentionConfig(n_heads=12, bias=True),
        block=BlockConfig(norm="layernorm", norm_placement="pre", mlp="gelu_tanh", bias=True),
        positions=Learned(),
        tie_embeddings=True,
        eos_token_id=50256,
        bos_token_id=50256,
    ),
    "bert-base": lambda: _bert(30522, 768, 12, 12, 3072),
    "minilm-l6": lambda: _bert(30522, 384, 6, 12, 1536),
    "llama2-7b": lambda: _llama(32000, 4096, 32, 32, 32, 11008, 10000.0, 4096),
    "llama3-8b": lambda: _llama(128256, 4096, 32, 32, 8, 14336, 500000.0, 8192),
    # Llama 3.1 / 3.2 config.json: rope_type llama3, factor 8 (3.1) or 32 (3.2), frequency factors
    # 1 and 4, original context 8192 stretched to 131072; 3.2-1B ties its embeddings.
    "llama3.1-8b": lambda: _llama(
        128256, 4096, 32, 32, 8, 14336, 500000.0, 131072, scaling=_llama31_rope(8.0), ids=(128000, 128001)
    ),
    "llama3.2-1b": lambda: _llama(
        128256, 2048, 16, 32, 8, 8192, 500000.0, 131072, scaling=_llama31_rope(32.0), tie=True, ids=(128000, 128001)
    ),
    # ~1M parameters, GQA 4:2: for tests, demos and CPU experiments.
    "llama-tiny": lambda: _llama(256, 128, 4, 4, 2, None, 10000.0, 512),
    # The default training run (issue 4): a small pre-LN char-level decoder sized for 2 CPU cores
    # (~0.83M parameters). the packaged shakespeare-char recipe trains it with a 64-char context
    # (model.max_seq_len: 64) and the tokenizer's vocab_size.
    "shakespeare-char": lambda: ModelConfig(
        arch="decoder",
        vocab_size=128,
        d_model=128,
        n_layers=4,
        max_seq_len=256,
        attention=AttentionConfig(n_heads=4),
        block=BlockConfig(norm="layernorm", norm_placement="pre", mlp="gelu", bias=True),
        positions=Learned(),
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-0.6B config.json: explicit head_dim 128 (16 heads > d_model / 128), per-head
    # QK-norm, GQA 16:8, RoPE base 1e6, tied embeddings, no sliding window.
    "qwen3-0.6b": lambda: ModelConfig(
        arch="decoder",
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        max_seq_len=40960,
        attention=AttentionConfig(n_heads=16, n_kv_heads=8, head_dim=128, qk_norm="head"),
        block=BlockConfig(norm="rmsnorm", norm_eps=1e-6, norm_placement="pre", mlp="swiglu", d_ff=3072),
        positions=RoPE(base=1_000_000.0),
        tie_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # google/gemma-3-1b-pt config.json: 5 sliding (window 512, RoPE base 10000) : 1 global (base
    # 1e6) layers, MQA with head_dim 256, per-head QK-norm, (1 + w) RMSNorms in sandwich
    # placement, gated tanh-GELU, embeddings times sqrt(1152), tied head, no soft-caps.
    "gemma3-1b": lambda: ModelConfig(
        arch="decoder",
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        max_seq_len=32768,
        attention=AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=256, qk_norm="head"),
        block=BlockConfig(norm="rmsnorm_1p", norm_eps=1e-6, norm_placement="sandwich", mlp="geglu_tanh", d_ff=6912),
        positions=RoPE(base=1_000_000.0),
        tie_embeddings=True,
        embed_scale=True,
        embed_scale_in_dtype=True,
        layer_kinds=layer_pattern(("sliding",) * 5 + ("full",), 26),
        kinds=(LayerKind(name="sliding", sliding_window=512, rope=RoPE(base=10_000.0)), LayerKind(name="full")),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    ),
    # EleutherAI/pythia-160m config.json: GPT-NeoX, parallel residual, rotary_pct 0.25, untied embed_out.
    "pythia-160m": lambda: ModelConfig(
        arch="decoder",
        vocab_size=50304,
        d_model=768,
        n_layers=12,
        max_seq_len=2048,
        attention=AttentionConfig(n_heads=12, bias=True),
        block=BlockConfig(norm="layernorm", norm_placement="parallel", mlp="gelu", d_ff=3072, bias=True),
        positions=RoPE(fraction=0.25),
        tie_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # microsoft/Phi-3-mini-4k-instruct config.json: Llama-shaped (fused qkv_proj/gate_up_proj on
    # disk), 32 heads without GQA, sliding window 2047 on every layer, untied head.
    "phi3-mini": lambda: ModelConfig(
        arch="decoder",
        vocab_size=32064,
        d_model=3072,
        n_layers=32,
        max_seq_len=4096,
        attention=AttentionConfig(n_heads=32, n_kv_heads=32, sliding_window=2047),
        block=BlockConfig(norm="rmsnorm", norm_eps=1e-5, norm_placement="pre", mlp="swiglu", d_ff=8192),
        positions=RoPE(base=10000.0),
        tie_embeddings=False,
        pad_token_id=32000,
        bos_token_id=1,
        eos_token_id=32000,
    ),
    # google-t5/t5-small (v1.0: ReLU, tied head scaled by d_model ** -0.5) and google/flan-t5-base
    # (v1.1: gated gelu_new, untied, unscaled): RMS-only norms, unscaled scores, relative bias.
    "t5-small": lambda: _t5(512, 6, 8, 2048, "relu", tied=True),
    "flan-t5-base": lambda: _t5(768, 12, 12, 2048, "geglu_tanh", tied=False),
    # FacebookAI/roberta-base config.json: BERT's shape, positions after the pad id 1 (514-row
    # table), one token type, eps 1e-5.
    "roberta-base": lambda: _bert(50265, 768, 12, 12, 3072).replace(
        positions=Learned(offset=2),
        encoder_positions="counted",  # fairseq numbers real tokens only
        n_token_types=1,
        block={"norm_eps": 1e-5},
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    ),
}


_PRESETS.update(MOE_PRESETS)  # mixtral-8x7b, deepseek-v3, moe-tiny (moe_presets.py)


def names() -> list[str]:
    """The preset names, sorted.

    >>> "llama3-8b" in names() and "shakespeare-char" in names()
    True
    """
    return sorted(_PRESETS)


def get(name: str, **changes) -> ModelConfig:
    """The preset ``name``, optionally with fields replaced (nested configs as dicts).

    >>> cfg = get("llama-tiny", n_layers=2)
    >>> cfg.arch, cfg.n_layers
    ('decoder', 2)
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {names()}")
    cfg = _PRESETS[name]()
    return cfg.replace(**changes) if changes else cfg
