"""Expert families against transformers: Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert with a
sigmoid gate) and DeepSeek-V3 (MLA, sigmoid group-limited routing, shared experts, dense-first
layers). Each: logits on a padded 4 x 64 batch within 1e-4, greedy 16 tokens == generate, HF ->
torchformer -> HF through transformers' loader, torchformer -> HF -> torchformer with bit-equal
tensors, the per-expert <-> batched transforms, and bad checkpoints named before any tensor is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T

from torchformer.interop import config_from_hf, from_hf, to_hf
from torchformer.interop.hf_mixtral import stack_experts, unstack_experts
from torchformer.models import saving

from . import family_checks as fc

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.2, max_position_embeddings=128)  # fmt: skip
SPECS = {
    "mixtral": lambda: (
        T.MixtralConfig(
            **BASE, num_key_value_heads=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
        ),  # fmt: skip
        T.MixtralForCausalLM,
    ),
    # layer 1 dense (mlp_only_layers), 6 experts top-3, renormalised, per-head QK-norm, explicit head_dim
    "qwen3_moe": lambda: (
        T.Qwen3MoeConfig(**BASE, num_key_value_heads=2, head_dim=24, intermediate_size=48, moe_intermediate_size=32,
                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1]),
        T.Qwen3MoeForCausalLM,
    ),
    # q/k/v biases, a sigmoid-gated shared expert, top-2 of 4 not renormalised
    "qwen2_moe": lambda: (
        T.Qwen2MoeConfig(**BASE, num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=32,
                         shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2),
        T.Qwen2MoeForCausalLM,
    ),
    # MLA with a low-rank q, interleaved rotary pairs; layer 0 dense; 8 experts in 4 groups, best 2
    # groups, top-3, sigmoid + selection bias, renormalised, scale 2.5; one shared expert
    "deepseek_v3": lambda: (
        T.DeepseekV3Config(**BASE, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=24,
                           n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=12),
        T.DeepseekV3ForCausalLM,
    ),
    # full-rank q, half-split rotary pairs, yarn x4 with mscale_all_dim (softmax scale x mscale^2), no
    # dense layer, no groups, top-2 not renormalised
    "deepseek_v3-yarn": lambda: (
        T.DeepseekV3Config(**dict(BASE, max_position_embeddings=128), num_key_value_heads=4, intermediate_size=48,
                           moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                           topk_group=1, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False,
                           kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                           rope_interleave=False,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 32, "mscale": 1.0,
                                            "mscale_all_dim": 1.0}),
        T.DeepseekV3ForCausalLM,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            config, cls = SPECS[name]()
            folder = tmp_path_factory.mktemp(name)
            made[name] = folder, fc.saved(cls, config, folder)
        return made[name]

    return make


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_hf_on_a_padded_batch(family, name):
    folder, hf = family(name)
    assert fc.decoder_max_diff(folder, hf, 128) < fc.TOL


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_16_tokens_match_generate(family, name):
    folder, hf = family(name)
    fc.decoder_greedy_equal(folder, hf, 128)


@pytest.mark.parametrize("name", list(SPECS))
def test_hf_round_trip_loads_in_transformers(family, tmp_path, name):
    folder, hf = family(name)
    ids = torch.randint(3, 128, (2, 40))
    run = lambda m: m(input_ids=ids).logits  # noqa: E731
    fc.hf_round_trip(folder, hf, T.AutoModelForCausalLM, tmp_path / "export", run, model_type=name.split("-")[0])


@pytest.mark.parametrize("name", list(SPECS))
def test_ours_round_trip_has_bit_equal_tensors(family, tmp_path, name):
    cfg = config_from_hf(family(name)[0])
    fc.ours_round_trip(cfg, tmp_path / "a", name.split("-")[0])


def test_expert_transforms_round_trip():
    per_expert = [torch.randn(6, 4) for _ in range(5)]
    (batched,) = stack_experts(per_expert)
    assert batched.shape == (5, 6, 4) and torch.equal(batched[3], per_expert[3])
    back = unstack_experts([batched])
    assert all(torch.equal(a, b) for a, b in zip(back, per_expert, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in back}) == 5  # own storage each (safetensors)
    meta = stack_experts([torch.empty(6, 4, device="meta")] * 5)[0]  # the loader predicts shapes on meta
    assert meta.shape == (5, 6, 4)


@pytest.fixture
def reads(monkeypatch):
    """Names of the tensors whose data a load reads: every safetensors file the loader opens
    (models/saving.py's safe_open) records get_tensor, its only way to read data."""
    calls = []

    class Handle:
        def __init__(self, handle):
            self.handle = handle

        def get_tensor(self, name):
            calls.append(name)
            return self.handle.get_tensor(name)

        def __getattr__(self, attr):  # keys, get_slice(...).get_shape(), metadata: the header
            return getattr(self.handle, attr)

    opened = saving.safe_open
    monkeypatch.setattr(saving, "safe_open", lambda *a, **k: Handle(opened(*a, **k)))
    return calls


@pytest.mark.parametrize("name", list(SPECS))
def test_expert_count_mismatch_is_named_before_reading(family, tmp_path, name, reads):
    folder, _ = family(name)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    hf = json.loads((folder / "config.json").read_text())
    key = next(k for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in hf)
    (bad / "config.json").write_text(json.dumps(dict(hf, **{key: hf[key] * 2})))
    with pytest.raises(ValueError, match=r"missing tensors: .*experts\.\d+\."):
        from_hf(bad)
    assert reads == []
    from_hf(folder)  # the spy sees a load that does read
    assert reads


def test_to_hf_refuses_a_dense_model_as_mixtral(tmp_path):
    import torchformer as tfm

    with pytest.raises(ValueError, match="needs moe"):
        to_hf(tfm.build_model(tfm.presets.get("llama-tiny")), tmp_path / "x", model_type="mixtral")


def test_sparse_step_and_dense_first_read_as_layer_kinds(family):
    from torchformer.interop import hf_deepseek, hf_qwen3_moe
    from torchformer.models.kinds import resolve_kinds

    def mlps(cfg):
        kinds, index = resolve_kinds(cfg, cfg.n_layers)
        return [kinds[i].mlp for i in index]

    hf = json.loads((family("qwen3_moe")[0] / "config.json").read_text())
    every_other = hf_qwen3_moe.config_from_hf(dict(hf, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[]))
    assert mlps(every_other) == ["dense", "moe", "dense", "moe"]  # (i + 1) % 2 == 0 are sparse
    assert hf_qwen3_moe.config_to_hf(every_other, "float32")[0]["mlp_only_layers"] == [0, 2]
    hf = json.loads((family("deepseek_v3")[0] / "config.json").read_text())
    assert mlps(hf_deepseek.config_from_hf(dict(hf, first_k_dense_replace=2))) == ["dense", "dense", "moe"]
