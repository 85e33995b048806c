"""A small model of the same variant, for verifying presets too large to build on a CPU.

Kept: arch, norm and placement, positions, MLP kind, the d_ff / d_model ratio, bias settings,
backend, sliding window, tying and embedding options, the query/kv head ratio (GQA stays GQA, MHA
stays MHA), and max_seq_len. Shrunk: width (head_dim 16), depth (2 layers each side) and the
vocabulary (at most 512; special token ids above it are clamped into range).
"""

from __future__ import annotations

from ..configs import ModelConfig

HEAD_DIM, LAYERS, VOCAB, HEADS = 16, 2, 512, 4


def shrink_config(cfg: ModelConfig) -> ModelConfig:
    """The same variant at a test size: ~d_model 64, 2 layers, vocab <= 512."""
    a = cfg.attention
    group = a.n_heads // cfg.n_kv_heads  # queries per kv head: 1 MHA, n_heads MQA
    kv = max(1, HEADS // group)
    heads = kv * group
    d_model = heads * HEAD_DIM
    d_ff = None if cfg.block.d_ff is None else max(8, round(cfg.d_ff * d_model / cfg.d_model))
    vocab = min(cfg.vocab_size, VOCAB)
    ids = {
        name: None if getattr(cfg, name) is None else min(getattr(cfg, name), vocab - 1)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    }
    window = a.sliding_window
    # Layer kinds: one layer of each kind, in order of first use (Gemma 3: sliding, full).
    kinds = None if cfg.layer_kinds is None else tuple(dict.fromkeys(cfg.layer_kinds))
    return cfg.replace(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=min(cfg.n_layers, LAYERS) if kinds is None else len(kinds),
        layer_kinds=kinds,
        n_decoder_layers=None if cfg.n_decoder_layers is None else min(cfg.n_decoder_layers, LAYERS),
        attention={"n_heads": heads, "n_kv_heads": kv, "head_dim": None, "sliding_window": window},
        block={"d_ff": d_ff},
        **ids,
    )
