"""Llama with every scaled RoPE against transformers' LlamaForCausalLM (issue 14, part A).

Each rope type is set so the scaling bites: original context 16, batches of 64 tokens (dynamic
and longrope switch rule at 16), factors 4-8, and q/k weights large enough (initializer 0.2)
that a wrong rotation moves the logits far past the tolerance (checked: the unscaled model
fails). HF's dynamic module keeps state between calls (the largest length seen), so every
comparison loads a fresh HF model from the saved folder.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import torchformer as tfm
from torchformer.configs import DynamicNTK, LinearScaling, Llama3Scaling, LongRoPE, RoPE, YaRN
from torchformer.interop import config_from_hf, from_hf, to_hf

from .test_parity import hf_positions, left_padded, until_eos

TOL = 1e-4
ORIGINAL = 16
SHORT = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0]  # longrope: one factor per frequency (head_dim 16)
LONG = [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 10.0]
ROPES = {  # name -> (rope_parameters, max_position_embeddings)
    "linear": (dict(rope_type="linear", factor=4.0), 64),
    "dynamic": (dict(rope_type="dynamic", factor=4.0), ORIGINAL),  # HF's original is max_position_embeddings
    "llama3": (
        dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0),
        64,
    ),
    "yarn": (dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=0.5), 64),
    "yarn-mscale": (dict(rope_type="yarn", factor=4.0, mscale=0.8, mscale_all_dim=0.3, truncate=False), 64),
    "yarn-attention-factor": (dict(rope_type="yarn", factor=None, attention_factor=1.3), 64),
    "longrope": (dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG), 64),
}
for _params, _max in ROPES.values():
    if _params["rope_type"] in ("llama3", "yarn", "longrope"):
        _params["original_max_position_embeddings"] = ORIGINAL


def hf_config(name: str, **changes) -> T.LlamaConfig:
    params, max_len = ROPES[name]
    return T.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        rope_parameters={"rope_theta": 10000.0, **params},
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **changes,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a saved tiny HF Llama with that RoPE (built once per module)."""
    cache: dict[str, object] = {}

    def make(name: str):
        if name not in cache:
            torch.manual_seed(1234)
            folder = tmp_path_factory.mktemp(name)
            T.LlamaForCausalLM(hf_config(name)).save_pretrained(folder)
            cache[name] = folder
        return cache[name]

    return make


def fresh_hf(folder) -> T.LlamaForCausalLM:
    return T.LlamaForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("name", sorted(ROPES))
@torch.no_grad()
def test_logits_match_hf_on_a_padded_4x64_batch(folders, name):
    folder = folders(name)
    ours = from_hf(folder)
    assert type(ours.config.positions.scaling).__name__ != "NoneType"
    torch.manual_seed(0)
    ids, mask = left_padded(4, 64, 128, [0, 7, 20, 33])
    want = fresh_hf(folder)(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
    real = mask.bool()
    assert (ours(ids, attention_mask=mask)[real] - want[real]).abs().max() < TOL
    # The scaling bites: the same weights with plain RoPE are far off.
    plain = from_hf(folder)
    plain.stack.rope = tfm.build_model(ours.config.replace(positions=RoPE())).stack.rope
    assert (plain(ids, attention_mask=mask)[real] - want[real]).abs().max() > 100 * TOL
    # Short inputs (longrope's short factors, dynamic's unscaled base) on a fresh HF model.
    short = ids[:1, -12:]
    assert (ours(short) - fresh_hf(folder)(input_ids=short).logits).abs().max() < TOL


@pytest.mark.parametrize("name", sorted(ROPES))
@torch.no_grad()
def test_greedy_16_tokens_match_hf_generate(folders, name):
    """A 12-token prompt and 16 new tokens: dynamic and longrope cross the original length
    during the cached decode, so this also checks that cached keys keep their rotation as HF's do."""
    folder = folders(name)
    ours = from_hf(folder)
    torch.manual_seed(1)
    ids, mask = left_padded(2, 12, 128, [0, 3])
    hf = fresh_hf(folder)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, num_beams=1, pad_token_id=0)
    got = tfm.generate(ours, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2, pad_token_id=0)
    for row_got, row_want in zip(got.tolist(), want.tolist()):
        row_want = until_eos(row_want[12:], 2)
        assert len(row_want) >= 4  # a real comparison, not an early stop
        assert row_got[12 : 12 + len(row_want)] == row_want


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
@torch.no_grad()
def test_cached_steps_across_the_original_length_match_hf_cached_steps(folders, name):
    """Prefill 10 tokens, then feed 14 more one at a time (length 11 -> 24, crossing 16): every
    step's logits equal HF's cached forward; and they differ from a full recomputation, which
    rotates the old keys by the new rule (the documented behaviour, as in HF)."""
    folder = folders(name)
    ours, hf = from_hf(folder), fresh_hf(folder)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    cache = ours.new_cache(2, 24)
    pos = torch.arange(24)[None].expand(2, -1)
    got = [ours(ids[:, :10], positions=pos[:, :10], cache=cache)[:, -1]]
    out = hf(input_ids=ids[:, :10], use_cache=True)
    want, past = [out.logits[:, -1]], out.cache
    for t in range(10, 24):
        got.append(ours(ids[:, t : t + 1], positions=pos[:, t : t + 1], cache=cache)[:, -1])
        out = hf(input_ids=ids[:, t : t + 1], cache=past, use_cache=True)
        want.append(out.logits[:, -1])
        past = out.cache
    assert (torch.stack(got) - torch.stack(want)).abs().max() < TOL
    full = ours(ids)[:, -1]
    assert (full - got[-1]).abs().max() > 100 * TOL


@pytest.mark.parametrize("name", sorted(ROPES))
@torch.no_grad()
def test_hf_to_ours_to_hf_loads_in_transformers_unchanged(folders, tmp_path, name):
    folder = folders(name)
    out = to_hf(from_hf(folder), tmp_path / "export")
    again, info = T.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf = fresh_hf(folder)
    for key, tensor in again.state_dict().items():
        assert torch.equal(tensor, hf.state_dict()[key]), key
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)


TINY = dict(vocab_size=128, d_model=64, n_layers=2, attention={"n_heads": 4, "n_kv_heads": 2}, block={"d_ff": 96})
OURS = {
    "linear": (LinearScaling(factor=2.5), 64),
    "dynamic": (DynamicNTK(factor=4.0, original_max_seq_len=16), 64),
    "llama3": (Llama3Scaling(factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_seq_len=32), 256),
    "yarn": (YaRN(factor=None, original_max_seq_len=16, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.5), 64),
    "longrope": (LongRoPE(short_factor=SHORT, long_factor=LONG, original_max_seq_len=16, factor=3.0), 64),
}


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@torch.no_grad()
def test_ours_to_hf_to_ours_is_bit_equal(tmp_path, name, pairing):
    scaling, max_len = OURS[name]
    cfg = tfm.presets.get("llama-tiny", **TINY, max_seq_len=max_len, positions=RoPE(pairing=pairing, scaling=scaling))
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    for p in model.parameters():
        p.normal_()
    folder = to_hf(model, tmp_path / "hf")
    again = from_hf(folder, rope_pairing=pairing)
    assert again.config.positions == cfg.positions and again.config.max_seq_len == cfg.max_seq_len
    assert again.state_dict().keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key
    ids = torch.randint(0, 128, (2, max_len))
    assert torch.equal(again(ids), model(ids))


def write_config(tmp_path, **changes) -> str:
    """A folder with only a config.json: loading must fail on it before looking for tensors."""
    hf = hf_config("llama3").to_dict()
    hf.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


BAD = {
    "unsupported type": (
        dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
        "rope_type='proportional'",
    ),
    "longrope length": (
        dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 5, "long_factor": LONG}),
        "short_factor='<5 numbers>': needs 8",
    ),
    "longrope not numbers": (
        dict(rope_parameters={"rope_type": "longrope", "short_factor": "1,2", "long_factor": LONG}),
        "short_factor='1,2'",
    ),
    "llama3 missing": (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor: missing"),
    "llama3 bands": (
        dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
        "high_freq_factor=1.0: must be > low_freq_factor=4.0",
    ),
    "yarn beta": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": -1.0}), "beta_fast=-1.0"),
    "linear factor": (dict(rope_parameters={"rope_type": "linear", "factor": "2"}), "factor='2'"),
    "partial rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rope_settings_fail_on_config_json_alone(tmp_path, case):
    changes, needle = BAD[case]
    folder = write_config(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        from_hf(folder)
    assert needle in str(err.value)
    if case == "unsupported type":
        assert "['default', 'linear', 'dynamic', 'llama3', 'yarn', 'longrope']" in str(err.value)
    with pytest.raises(ValueError, match=needle.split("=")[0]):
        config_from_hf(folder)


def test_dynamic_export_needs_the_length_config_json_can_say(tmp_path):
    cfg = tfm.presets.get(
        "llama-tiny", **TINY, max_seq_len=50, positions=RoPE(scaling=DynamicNTK(factor=4.0, original_max_seq_len=16))
    )
    with pytest.raises(ValueError, match="max_seq_len=50 with dynamic RoPE: must be .* = 64"):
        to_hf(tfm.build_model(cfg), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3.1-8b"])
def test_llama3x_presets_count_what_transformers_builds(name):
    """Exact parameter counts against LlamaForCausalLM built from the same config.json on meta."""
    cfg = tfm.presets.get(name)
    hf, _ = tfm.interop.FAMILIES["llama"].config_to_hf(cfg, "bfloat16")
    assert hf["rope_parameters"]["rope_type"] == "llama3" and hf["rope_parameters"]["factor"] in (8.0, 32.0)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**hf))
    assert tfm.count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert tfm.count_params(cfg) == {"llama3.2-1b": 1_235_814_400, "llama3.1-8b": 8_030_261_248}[name]


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "longrope", "dynamic"])
def test_transformers_4x_rope_scaling_reads_as_the_5x_form(tmp_path, folders, name):
    """Older config.json files: top-level rope_theta and rope_scaling with "type" or "rope_type"."""
    hf = json.loads((folders(name) / "config.json").read_text())
    params = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(hf))
    old, new = config_from_hf(tmp_path), config_from_hf(folders(name))
    assert old == new and old.positions.scaling is not None
