"""Model configuration: frozen, typed, nested by concern, validated once. Imports no torch.

The floor everything else stands on (tests/test_layering.py): these modules import only each
other, in one direction: rules <- rope_scaling <- positions <- blocks, moe, layers <- model.

  rules.py         the checks every config class shares; JSON readers of tagged unions
  rope_scaling.py  RoPE's context-extension schemes (linear, dynamic NTK, YaRN, Llama 3, LongRoPE)
  positions.py     one class per position scheme (Sinusoidal, Learned, RoPE, ALiBi, RelativeBias)
  blocks.py        AttentionConfig, BlockConfig
  moe.py           MoE (expert MLPs), LatentAttention (DeepSeek's MLA)
  layers.py        LayerKind: layers that differ (windows, RoPE or NoPE, dense or expert MLP)
  model.py         ModelConfig, the whole model, and the rules between its parts
"""

from .blocks import GATED, AttentionConfig, BlockConfig, default_d_ff
from .layers import INHERIT, LayerKind, layer_pattern
from .model import ModelConfig
from .moe import LatentAttention, MoE, cache_widths
from .positions import POSITION_KINDS, ALiBi, Learned, Positions, RelativeBias, RoPE, Sinusoidal
from .rope_scaling import SCALING_KIND_OF, SCALING_KINDS, DynamicNTK, LinearScaling, Llama3Scaling, LongRoPE, YaRN

__all__ = [
    "ALiBi",
    "GATED",
    "AttentionConfig",
    "BlockConfig",
    "DynamicNTK",
    "INHERIT",
    "LayerKind",
    "Learned",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPE",
    "ModelConfig",
    "POSITION_KINDS",
    "Positions",
    "RelativeBias",
    "RoPE",
    "SCALING_KINDS",
    "SCALING_KIND_OF",
    "Sinusoidal",
    "YaRN",
    "LatentAttention",
    "MoE",
    "cache_widths",
    "default_d_ff",
    "layer_pattern",
]
