"""fp16 / bf16 forward at sequence length 4096 on CPU: no NaN or inf (1 layer, small width, so
the slow CPU half-precision matmuls finish in seconds)."""

import pytest
import torch

import torchformer as tfm

T = 4096
SHAPES = {
    # modern decoder: RMSNorm (fp32 reduction), RoPE, GQA, SwiGLU, sdpa
    "llama": dict(
        block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu", d_ff=64),
        positions=tfm.RoPE(),
        attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=2),
    ),
    # GPT-2 style with ALiBi: biases reach -slope * 4095 and go through sdpa as a float mask
    "alibi": dict(
        block=tfm.BlockConfig(norm="layernorm", mlp="gelu_tanh", d_ff=64),
        positions=tfm.ALiBi(),
        attention=tfm.AttentionConfig(n_heads=2, backend="sdpa"),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_half_precision_long_sequence_is_finite(dtype, shape):
    cfg = tfm.ModelConfig(vocab_size=64, d_model=32, n_layers=1, max_seq_len=T, **SHAPES[shape])
    model = tfm.build_model(cfg).eval().to(dtype)
    ids = torch.randint(0, 64, (1, T))
    logits = model(ids)
    assert logits.dtype == dtype and logits.shape == (1, T, 64)
    assert torch.isfinite(logits).all()
    # Not collapsed: the logits still follow the fp32 model's.
    ref = tfm.build_model(cfg).eval()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert (logits.float() - ref(ids)).abs().max().item() < 0.05
