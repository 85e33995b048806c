"""The native batch-1 decode step (fast/native_step.py, csrc/step.cpp): over a grid of Llama-shaped
bf16 decoders (bf16 / int8 / int4 weights x MHA / GQA / MQA x q/k/v biases x tied or untied heads x
plain or scaled RoPE), a compiled greedy generate takes the native step and gives the eager
generate's tokens and logits; models it does not compute (QK-norm, Gemma's norm, post-norm, an fp32
model, two rows) keep the compiled graph; TORCHFORMER_NATIVE_STEP=0 turns it off, a bad value is a
clear error; a cache it cannot take sends the loop to the compiled step."""

import sys
import weakref

import pytest
import torch

import torchformer as tfm
from torchformer.configs import YaRN
from torchformer.fast import formats, native_step
from torchformer.fast.bf16 import DOT_UNITS
from torchformer.fast.scope import packed
from torchformer.generation.generate import decode
from torchformer.generation.request import make_request, sampling_options

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (no AVX-512 or no compiler)"
)

GREEDY = sampling_options(0.0, None, None, None, 1.0, 0)
# Widths of whole interleaved panel groups (4 x 16 rows) for every member: q 256, k/v 64-256, gate 512.
D, HEADS, VOCAB = 256, 4, 512


def model_for(fmt: str, kv_heads: int = 2, bias: bool = False, tied: bool = False, scaled: bool = False, **changes):
    rope = tfm.RoPE(pairing="half", scaling=YaRN(factor=4.0, original_max_seq_len=16) if scaled else None)
    cfg = tfm.ModelConfig(
        arch="decoder", vocab_size=VOCAB, d_model=D, n_layers=2, max_seq_len=96, positions=rope,
        attention=tfm.AttentionConfig(n_heads=HEADS, n_kv_heads=kv_heads, bias=bias),
        block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu", d_ff=512), tie_embeddings=tied,
    ).replace(**changes)  # fmt: skip
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(std=0.3)  # attention that matters (tests/grid.py ``build``)
            elif name.endswith("bias"):
                p.normal_(std=0.1)
    model = model.to(torch.bfloat16)
    if fmt != "bf16":
        tfm.quantize(model, fmt, group_size=64 if fmt == "int4" else None)
    return model


def run(model, compiled: bool, rows: int = 1):
    ids = torch.randint(1, VOCAB, (rows, 9), generator=torch.Generator().manual_seed(2))
    req = make_request(model, ids, max_new_tokens=24, attention_mask=None, eos_token_id=None)
    pairs = list(decode(model, req, GREEDY, None, compiled, scores=True))
    return torch.stack([t for t, _ in pairs], 1), torch.stack([lg for _, lg in pairs], 1)


def planned(model, rows: int = 1):
    with packed(model, rows):
        return native_step.plan(model, rows, lambda: None)


GRID = [
    ("bf16", 2, False, True, False),
    ("bf16", 4, True, False, True),
    ("int8", 1, True, True, False),
    ("int8", 2, False, False, True),
    ("int4", 4, False, True, True),
    ("int4", 2, True, False, False),
    ("int4", 1, False, False, False),
]


@pytest.mark.parametrize("fmt,kv_heads,bias,tied,scaled", GRID)
def test_the_native_step_decodes_as_the_eager_model(fmt, kv_heads, bias, tied, scaled):
    if fmt == "bf16" and not DOT_UNITS:
        pytest.skip("bf16 weights take the native step only with AVX512-BF16")
    model = model_for(fmt, kv_heads, bias, tied, scaled)
    assert planned(model) is not None  # the compiled run below is the native one
    tok, logits = run(model, True)
    eager_tok, eager_logits = run(model, False)
    assert torch.equal(tok, eager_tok)
    # the model's rounding points and kernels; the norms' sums in another order: within bf16's ulp
    torch.testing.assert_close(logits, eager_logits, rtol=2**-7, atol=2**-7 * eager_logits.abs().amax().item())
    assert (logits == eager_logits).float().mean() > 0.99


@pytest.mark.parametrize(
    "why,fmt,changes",
    [
        ("qk-norm", "int4", dict(attention=tfm.AttentionConfig(n_heads=HEADS, n_kv_heads=2, qk_norm="head"))),
        ("gemma norm", "int8", dict(block=tfm.BlockConfig(norm="rmsnorm_1p", mlp="swiglu", d_ff=512))),
        (
            "post-norm",
            "int4",
            dict(block=tfm.BlockConfig(norm="rmsnorm", norm_placement="post", mlp="swiglu", d_ff=512)),
        ),
        ("gelu mlp", "int8", dict(block=tfm.BlockConfig(norm="rmsnorm", mlp="gelu", d_ff=512))),
    ],
)
def test_models_it_does_not_compute_keep_the_compiled_step(why, fmt, changes):
    assert planned(model_for(fmt, **changes)) is None, why


def test_an_fp32_model_two_rows_and_another_token_table_keep_the_compiled_step():
    assert planned(model_for("int4").float()) is None
    assert planned(model_for("int4"), rows=2) is None
    model = model_for("int4")
    table = type("MappedTable", (torch.nn.Module,), {})()  # a GGUF file's table: no weight (interop/gguf)
    model.embed.tok = table
    assert planned(model) is None


def test_the_environment_turns_it_off_and_a_bad_value_is_an_error_before_any_work(monkeypatch):
    model = model_for("int4")
    monkeypatch.setenv("TORCHFORMER_NATIVE_STEP", "0")
    assert planned(model) is None
    monkeypatch.setenv("TORCHFORMER_NATIVE_STEP", "yes")
    prefills = []
    monkeypatch.setattr(model, "hidden", lambda *a, **k: prefills.append(1))
    with pytest.raises(ValueError, match="TORCHFORMER_NATIVE_STEP must be 0 or 1, got 'yes'"):
        tfm.generate(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, compile=True)
    assert not prefills


def test_a_hooked_module_keeps_the_compiled_step():
    """A hook runs in a module's forward, which the native step never calls."""
    model = model_for("int4")
    handle = model.stack.blocks[1].mlp.register_forward_hook(lambda m, i, o: None)
    assert planned(model) is None
    handle.remove()
    assert planned(model) is not None


def test_a_cache_it_cannot_take_sends_the_loop_to_the_compiled_step(monkeypatch):
    model = model_for("int4")
    calls = []

    def refuse(self, cache):
        calls.append(cache)
        return False

    monkeypatch.setattr(native_step.NativeStep, "bind", refuse)
    tok, logits = run(model, True)
    monkeypatch.setenv("TORCHFORMER_NATIVE_STEP", "0")
    compiled_tok, compiled_logits = run(model, True)  # the compiled graph's own step
    assert calls and torch.equal(tok, compiled_tok) and torch.equal(logits, compiled_logits)


def test_bad_positions_and_tokens_are_refused_before_any_work():
    model = model_for("int4")
    with packed(model, 1):
        step = native_step.plan(model, 1, lambda: None)
        cache = model.new_cache(1, 8)
        assert step.bind(cache)
        with pytest.raises(RuntimeError, match="position 9 is outside the cache of 9 slots"):
            step.step.run(3, 9)
        with pytest.raises(RuntimeError, match=f"token {VOCAB} is outside the vocabulary of {VOCAB}"):
            step.step.run(VOCAB, 0)


def test_an_eos_ends_the_native_loop_as_it_ends_the_eager_one():
    model = model_for("int4")
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    eager = tfm.generate(model, ids, max_new_tokens=24)
    eos = int(eager[0, 9 + 5])  # the sixth new token
    expected = tfm.generate(model, ids, max_new_tokens=24, eos_token_id=eos)
    assert expected.shape[1] < eager.shape[1]
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=24, eos_token_id=eos, compile=True), expected)


def test_sampling_runs_the_native_step_through_the_loop(monkeypatch):
    """Not greedy: the loop samples from the native step's logits (the same as eager's here)."""
    model = model_for("int8")
    calls = []
    run_step = native_step.NativeStep.__call__
    monkeypatch.setattr(native_step.NativeStep, "__call__", lambda *a: calls.append(1) or run_step(*a))
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=16, temperature=0.8, top_k=50, seed=7)
    sampled = tfm.generate(model, ids, compile=True, **kw)
    assert len(calls) == 15 and torch.equal(sampled, tfm.generate(model, ids, **kw))


def test_a_token_table_the_head_does_not_match_keeps_the_compiled_step():
    """The native step's own checks (csrc/step.cpp): a table of another vocabulary than the head's."""
    model = model_for("bf16" if DOT_UNITS else "int8")
    with torch.no_grad():
        model.embed.tok = torch.nn.Embedding(VOCAB + 16, D).to(torch.bfloat16)
    assert planned(model) is None


@pytest.mark.skipif(not DOT_UNITS, reason="bf16 weights take the native step only with AVX512-BF16")
def test_the_team_picks_the_token_as_torchs_argmax_on_ties_and_nans():
    """Each thread takes the maximum of its share of the vocabulary (csrc/step.cpp ``choose``): equal
    logits everywhere give the first index, a NaN the first NaN, as torch's argmax does."""
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    for row, value in ((None, 0.0), (VOCAB - 7, float("nan"))):
        model = model_for("bf16")
        with torch.no_grad():
            model.lm_head.weight.zero_()
            if row is not None:
                model.lm_head.weight[row] = value
        assert planned(model) is not None
        eager = tfm.generate(model, ids, max_new_tokens=6)
        assert torch.equal(eager[0, 9:], torch.full((6,), 0 if row is None else row))
        assert torch.equal(tfm.generate(model, ids, max_new_tokens=6, compile=True), eager)


def test_the_token_iterator_gives_the_tokens_with_or_without_their_logits():
    """``decode`` without scores (generate, stream) runs the step's own token loop, with scores the
    one that also hands each step's logits on: the same tokens, normal tensors both."""
    model = model_for("int4")
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    req = make_request(model, ids, max_new_tokens=12, attention_mask=None, eos_token_id=None)
    plain = list(decode(model, req, GREEDY, None, True))
    pairs = list(decode(model, req, GREEDY, None, True, scores=True))
    assert len(plain) == 12 and not any(t.is_inference() for t in plain)
    assert torch.equal(torch.cat(plain), torch.cat([t for t, _ in pairs]))


def test_the_token_loop_is_an_iterator_that_keeps_its_step_and_raises_its_errors():
    """The step's token loop (csrc/py_iter.h: a plain CPython iterator type) keeps the step it runs
    once the caller has dropped it, ends after n tokens, and a step's error reaches Python as the
    RuntimeError the step raises, not a crash."""
    model = model_for("int4")
    with packed(model, 1):
        step = native_step.plan(model, 1, lambda: None)
        cache = model.new_cache(1, 8)  # slots 0..8
        assert step.bind(cache)
    assert len(list(step.step.greedy(3, 0, 3, []))) == 3
    it = step.step.greedy(3, 5, 10, [])
    assert iter(it) is it
    del step
    tokens = [next(it) for _ in range(4)]  # positions 5..8
    assert all(t.shape == (1,) and t.dtype == torch.long and 0 <= int(t) < VOCAB for t in tokens)
    with pytest.raises(RuntimeError, match="position 9 is outside the cache of 9 slots"):
        next(it)


def test_the_token_loop_holds_its_tokens_until_its_next_refill_and_none_after_its_end():
    """The loop's tokens come in blocks of 64 made ahead (csrc/step.cpp ``Greedy``) and it keeps a
    reference to each token it gave until it makes the next block, so a token the caller drops is
    freed there, not between two steps. Tokens kept across a refill stay what they were (each a view
    of its own block), dropped ones are freed at the refill, and the ended loop holds none."""
    model = model_for("int4")
    with packed(model, 1):
        step = native_step.plan(model, 1, lambda: None)
        cache = model.new_cache(1, 80)
        assert step.bind(cache)
    expected = [t for t, _ in step.step.greedy_scores(3, 0, 70, [])]  # fresh tensors a token
    it = step.step.greedy(3, 0, 70, [])
    first = next(it)
    dropped = weakref.ref(next(it))  # the caller lets go at once: the loop still holds it
    assert dropped() is not None
    kept = [first] + [next(it) for _ in range(62)]  # tokens 0 and 2..63: the first block given
    assert dropped() is not None
    kept.append(next(it))  # token 64: a new block, the first one let go of
    assert dropped() is None
    kept += list(it)
    assert len(kept) == 69 and torch.equal(torch.cat(kept), torch.cat(expected[:1] + expected[2:]))
    del it, first
    held_by_us = [sys.getrefcount(t) for t in [torch.zeros(1)]][0]  # a list's tensor counted the same way
    assert all(sys.getrefcount(t) == held_by_us for t in kept)  # no reference of the loop's left


@pytest.mark.parametrize("threads", [1, 3])
def test_a_team_of_another_size_decodes_the_same(threads):
    """Each thread's share of the heads (q/k/v rows and attention), of every product and of the
    vocabulary follows the team's size: one thread does it all, three split four KV heads unevenly
    (the team then shares the q/k/v product instead)."""
    model = model_for("int4", kv_heads=4)
    before = torch.get_num_threads()
    eager_tok, eager_logits = run(model, False)
    try:
        torch.set_num_threads(threads)
        tok, logits = run(model, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(tok, eager_tok)
    torch.testing.assert_close(logits, eager_logits, rtol=2**-7, atol=2**-7 * eager_logits.abs().amax().item())


@pytest.mark.skipif(not DOT_UNITS, reason="bf16 weights take the native step only with AVX512-BF16")
@pytest.mark.parametrize("d_model", [192, 512])
def test_head_sizes_off_and_on_the_bf16_units_scores_decode_as_eager(d_model):
    """The attention's scores take the bf16 units where the head size is a multiple of 32 (128 here),
    widened keys and FMAs otherwise (48): both give eager's tokens."""
    model = model_for("bf16", kv_heads=2, d_model=d_model)
    assert planned(model) is not None
    tok, logits = run(model, True)
    eager_tok, eager_logits = run(model, False)
    assert torch.equal(tok, eager_tok)
    torch.testing.assert_close(logits, eager_logits, rtol=2**-7, atol=2**-7 * eager_logits.abs().amax().item())
