"""Model configuration: frozen, typed, nested by concern, validated once. Imports no torch.

Every rule is checked in ``__post_init__``; all violations are gathered into one ``ValueError``
that names each field, its value and what is allowed. Configs round-trip through JSON with
``to_dict`` / ``from_dict``; position schemes carry a ``kind`` tag, and unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .blocks import AttentionConfig, BlockConfig, default_d_ff
from .layers import INHERIT, LayerKind, kind_from_dict, kinds_tuple
from .moe import LatentAttention, MoE, mixture_problems
from .positions import _KIND_OF, POSITION_KINDS, Positions, RoPE, Sinusoidal, position_dict, read_position
from .rules import _check, _check_choice, _from_plain, _raise, _reject_unknown, _type_problems

Arch = Literal["decoder", "encoder", "encoder_decoder"]
Init = Literal["normal", "xavier"]
# How an encoder numbers a padded row: by column (BERT) or by counting real tokens (RoBERTa, fairseq).
EncoderPositions = Literal["columns", "counted"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A whole model. ``arch`` picks the family; the nested configs pick every variant.

    positions None means no position information at all (a bag-of-tokens model).
    embed_scale multiplies token embeddings by sqrt(d_model) (Vaswani 2017, section 3.4).
    embed_norm puts a norm after the embedding sum (BERT, BART's layernorm_embedding).
    final_norm None means: a final norm for pre-norm stacks, none for post-norm ones.
    tie_embeddings ties the output projection to the (target) token embeddings;
    share_embeddings uses one token table for encoder and decoder (encoder_decoder only).
    embed_scale_in_dtype rounds the sqrt(d_model) factor to the activations' dtype first (Gemma).
    head_scale multiplies the final hidden state before the LM head (T5: d_model ** -0.5 when
    tied); final_softcap caps the logits as cap * tanh(logits / cap) (Gemma 2: 30).
    layer_kinds / kinds: layers that differ (window, RoPE or NoPE per kind; configs/layers.py).
    moe: expert MLPs (Mixtral, Qwen-MoE, DeepSeek); mla: multi-head latent attention (DeepSeek-V2/V3);
    both in configs/moe.py.
    encoder_positions (arch="encoder"): "columns" numbers tokens by column (BERT); "counted" by the
    real tokens before each one, so left padding does not shift them (RoBERTa's fairseq numbering).
    """

    arch: Arch = "decoder"
    vocab_size: int
    d_model: int
    n_layers: int
    n_decoder_layers: int | None = None
    max_seq_len: int = 1024
    attention: AttentionConfig
    block: BlockConfig = field(default_factory=BlockConfig)
    positions: Positions | None = field(default_factory=RoPE)
    tie_embeddings: bool = True
    share_embeddings: bool = True
    embed_scale: bool = False
    embed_norm: bool = False
    final_norm: bool | None = None
    final_logits_bias: bool = False
    n_token_types: int = 0
    dropout: float = 0.0
    init: Init = "normal"
    init_std: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None
    embed_scale_in_dtype: bool = False
    head_scale: float | None = None
    final_softcap: float | None = None
    layer_kinds: tuple[str, ...] | None = None
    kinds: tuple[LayerKind, ...] = ()
    moe: MoE | None = None
    mla: LatentAttention | None = None
    encoder_positions: EncoderPositions = "columns"

    def __post_init__(self) -> None:
        _raise("ModelConfig", _type_problems(self, ""))
        object.__setattr__(self, "kinds", kinds_tuple(self.kinds))  # a dict name -> kind is accepted
        if isinstance(self.layer_kinds, list):
            object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        p: list[str] = []
        _check_choice(p, "arch", self.arch, Arch)
        _check_choice(p, "init", self.init, Init)
        _check_choice(p, "encoder_positions", self.encoder_positions, EncoderPositions)
        if self.encoder_positions != "columns":
            _check(p, self.arch == "encoder", "encoder_positions", self.encoder_positions, "only for arch='encoder'")
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
            value = getattr(self, name)
            _check(p, isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
        if self.n_decoder_layers is not None:
            _check(
                p,
                self.arch == "encoder_decoder" and self.n_decoder_layers >= 1,
                "n_decoder_layers",
                self.n_decoder_layers,
                "only for arch='encoder_decoder', and >= 1",
            )
        _check(p, self.n_token_types >= 0, "n_token_types", self.n_token_types, "must be >= 0")
        _check(p, 0.0 <= self.dropout < 1.0, "dropout", self.dropout, "must be in [0, 1)")
        _check(p, self.init_std > 0, "init_std", self.init_std, "must be > 0")
        if not isinstance(self.attention, AttentionConfig):
            p.append(f"attention={self.attention!r}: must be an AttentionConfig")
        else:
            self.attention._problems(p)
            if self.attention.head_dim is None and self.attention.n_heads >= 1:
                _check(
                    p,
                    self.d_model % self.attention.n_heads == 0,
                    "d_model",
                    self.d_model,
                    f"must be divisible by attention.n_heads={self.attention.n_heads} (or give attention.head_dim)",
                )
        if not isinstance(self.block, BlockConfig):
            p.append(f"block={self.block!r}: must be a BlockConfig")
        else:
            self.block._problems(p)
        if self.positions is not None and type(self.positions) not in _KIND_OF:
            p.append(f"positions={self.positions!r}: must be one of {list(POSITION_KINDS)} or None")
        elif self.positions is not None:
            self.positions._problems(p)
            if isinstance(self.positions, RoPE) and isinstance(self.attention, AttentionConfig):
                hd = self._head_dim_or_none()
                if hd is not None:
                    self.positions.head_problems(hd, p)  # even width, partial rotary, longrope lists
            if isinstance(self.positions, Sinusoidal):
                _check(p, self.d_model % 2 == 0, "d_model", self.d_model, "sinusoidal positions need it even")
        if self.arch == "encoder" and isinstance(self.attention, AttentionConfig):
            _check(
                p,
                self.attention.sliding_window is None,
                "attention.sliding_window",
                self.attention.sliding_window,
                "is for causal decoders only",
            )
        if self.arch != "encoder":
            _check(p, self.n_token_types == 0, "n_token_types", self.n_token_types, "only for arch='encoder'")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None:
                _check(p, 0 <= value < self.vocab_size, name, value, f"must be in [0, vocab_size={self.vocab_size})")
        for name in ("head_scale", "final_softcap"):
            value = getattr(self, name)
            if value is not None:
                _check(p, math.isfinite(value) and value > 0, name, value, "must be a finite number > 0 (or None)")
        _kind_problems(self, self.n_layers, p)
        mixture_problems(self, p)
        _raise("ModelConfig", p)

    def _head_dim_or_none(self) -> int | None:
        a = self.attention
        if isinstance(self.mla, LatentAttention):  # the rotated width, as transformers' DeepSeek configs
            return self.mla.rope_dim
        if a.head_dim is not None:
            return a.head_dim
        return self.d_model // a.n_heads if a.n_heads >= 1 and self.d_model % a.n_heads == 0 else None

    # -- derived values (read once by the builder) ------------------------------------------
    @property
    def head_dim(self) -> int:
        hd = self._head_dim_or_none()
        assert hd is not None
        return hd

    @property
    def n_kv_heads(self) -> int:
        return self.attention.kv_heads

    @property
    def d_ff(self) -> int:
        return self.block.d_ff if self.block.d_ff is not None else default_d_ff(self.d_model, self.block.mlp)

    @property
    def decoder_layers(self) -> int:
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    @property
    def has_final_norm(self) -> bool:
        return self.block.norm_placement != "post" if self.final_norm is None else self.final_norm

    @property
    def is_causal(self) -> bool:
        return self.arch != "encoder"

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with fields changed; nested configs can be given as dicts of changes."""
        for name in ("attention", "block"):
            if isinstance(changes.get(name), dict):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready data (unions tagged with ``kind``); ``from_dict`` reads it back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["attention"] = dataclasses.asdict(self.attention)
        out["block"] = dataclasses.asdict(self.block)
        pos = self.positions
        out["positions"] = None if pos is None else position_dict(pos)
        out["layer_kinds"] = None if self.layer_kinds is None else list(self.layer_kinds)
        out["kinds"] = [k.to_dict() for k in self.kinds]
        for name in ("moe", "mla"):
            out[name] = None if getattr(self, name) is None else dataclasses.asdict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        _reject_unknown(cls, data, "ModelConfig")
        if isinstance(data.get("attention"), dict):
            data["attention"] = _from_plain(AttentionConfig, data["attention"], "attention")
        if isinstance(data.get("block"), dict):
            data["block"] = _from_plain(BlockConfig, data["block"], "block")
        if isinstance(data.get("kinds"), list):
            data["kinds"] = tuple(kind_from_dict(k) if isinstance(k, dict) else k for k in data["kinds"])
        for name, sub in (("moe", MoE), ("mla", LatentAttention)):
            if isinstance(data.get(name), dict):
                data[name] = _from_plain(sub, data[name], name)
        pos = data.get("positions", "absent")
        if isinstance(pos, dict):
            data["positions"] = read_position(pos)
        elif pos == "absent":
            data.pop("positions", None)
        return cls(**data)


def _kind_problems(cfg: ModelConfig, n_layers: int, p: list[str]) -> None:
    """Rules between layer_kinds, kinds and the rest of the model (checked by ModelConfig)."""
    names, kinds = cfg.layer_kinds, cfg.kinds
    if not isinstance(kinds, tuple) or not all(isinstance(k, LayerKind) for k in kinds):
        p.append(f"kinds={kinds!r}: must be a tuple of LayerKind (or a dict name -> LayerKind)")
        return
    defined = [k.name for k in kinds]
    _check(p, all(isinstance(n, str) and n for n in defined), "kinds", defined, "every kind needs a non-empty name")
    if len(set(defined)) != len(defined):
        p.append(f"kinds={defined}: kind names must be unique")
    if names is None:
        _check(p, not kinds, "kinds", defined, "needs layer_kinds naming each layer's kind")
        return
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        p.append(f"layer_kinds={names!r}: must be a tuple of kind names (see layer_pattern)")
        return
    _check(p, len(names) == n_layers, "layer_kinds", names, f"has {len(names)} names, needs one per layer ({n_layers})")
    unknown = sorted(set(names) - set(defined))
    _check(p, not unknown, "layer_kinds", names, f"names unknown kinds {unknown}; defined in kinds: {defined}")
    _check(p, cfg.arch != "encoder_decoder", "layer_kinds", names, "are for arch 'decoder' or 'encoder'")
    for k in kinds:
        _check(p, k.mlp != "moe" or cfg.moe is not None, f"kinds[{k.name!r}].mlp", k.mlp, "'moe' needs the model's moe")
        if k.sliding_window not in (None, INHERIT):
            _check(p, cfg.arch == "decoder", f"kinds[{k.name!r}].sliding_window", k.sliding_window,
                   "is for causal decoders only")  # fmt: skip
        if k.rope != INHERIT:
            ok = cfg.positions is None or isinstance(cfg.positions, RoPE)
            model = type(cfg.positions).__name__
            _check(p, ok, f"kinds[{k.name!r}].rope", k.rope, f"needs model positions RoPE or None, not {model}")
        if isinstance(k.rope, RoPE):
            hd = cfg._head_dim_or_none()
            k.rope._problems(p)
            if hd is not None:
                k.rope.head_problems(hd, p)
