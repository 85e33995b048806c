"""torchformer: the Transformer in all three shapes, small, readable, proven equal to the references.

The public surface (DESIGN section 5) is re-exported here; no logic lives in this file.
"""

from . import analysis, lora, presets
from ._version import __version__
from .analysis.accounting import count_params, flops_per_token, kv_cache_bytes
from .configs import (
    ALiBi,
    AttentionConfig,
    BlockConfig,
    DynamicNTK,
    LatentAttention,
    LayerKind,
    Learned,
    LinearScaling,
    Llama3Scaling,
    LongRoPE,
    ModelConfig,
    MoE,
    RelativeBias,
    RoPE,
    Sinusoidal,
    YaRN,
    layer_pattern,
)
from .evaluation import embed
from .generation import beam_search, generate, stream
from .interop import from_hf, to_hf
from .interop.gguf import from_gguf, to_gguf
from .loading import load_any, load_tokenizer
from .models.build import build_model
from .models.decoder import DecoderLM
from .models.encoder import Encoder
from .models.encoder_decoder import EncoderDecoder
from .models.quantize import quantize
from .models.saving import load, save
from .nn.kv_cache import KVCache
from .verify import verify

__all__ = [
    "layer_pattern",
    "__version__",
    "ALiBi",
    "AttentionConfig",
    "BlockConfig",
    "DynamicNTK",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPE",
    "YaRN",
    "DecoderLM",
    "Encoder",
    "EncoderDecoder",
    "KVCache",
    "LayerKind",
    "Learned",
    "ModelConfig",
    "MoE",
    "LatentAttention",
    "RelativeBias",
    "RoPE",
    "Sinusoidal",
    "analysis",
    "beam_search",
    "build_model",
    "count_params",
    "embed",
    "flops_per_token",
    "kv_cache_bytes",
    "generate",
    "from_gguf",
    "from_hf",
    "load",
    "load_any",
    "load_tokenizer",
    "lora",
    "presets",
    "quantize",
    "save",
    "to_gguf",
    "to_hf",
    "verify",
    "stream",
]
