"""fast/native.py's decode kernel (one query per row over the first n cached keys) equals SDPA over
that prefix: MHA, GQA and MQA, head widths that are and are not multiples of 16, a per-head bias
with -inf holes, a broadcast mask, no term at all; and a cached decode step routes through it
(fast/attention.py, the CPU kernel of nn/backends.py's prefix_sdpa op), whose C++ registration
(what a generation scope makes it) equals its Python one and can be given back."""

import pytest
import torch
import torch.nn.functional as F

from torchformer.fast import attention

from .built import built_kernels

SHAPES = [  # (B, H, K, E, S, n)
    (8, 8, 8, 64, 40, 17),
    (2, 8, 2, 32, 40, 40),
    (3, 4, 1, 24, 30, 1),
    (1, 6, 3, 8, 70, 33),
    (2, 2, 2, 80, 20, 19),
    (2, 4, 2, 128, 300, 300),  # the widest templated head, many 16-key blocks
    (3, 8, 8, 64, 80, 75),  # the serving benchmark's shape
    (2, 4, 4, 160, 40, 16),  # wider than the templated heads: the generic loop
]


@pytest.fixture(scope="module")
def kernel():
    return built_kernels()


@pytest.fixture
def python_kernel(monkeypatch):
    """The op's Python CPU kernel for the test (its spies watch it), whatever a generation scope
    registered before: scopes opened during the test leave it."""
    attention.native(False)
    monkeypatch.setattr(attention, "native", lambda on=True: False)


@pytest.mark.parametrize("B, H, K, E, S, n", SHAPES)
@pytest.mark.parametrize("term_kind", ["bias", "mask", "none"])
def test_decode_kernel_equals_sdpa_over_the_prefix(kernel, B, H, K, E, S, n, term_kind):
    g = torch.Generator().manual_seed(B * 100 + E + n)
    # Cache-like views: the slot dim has a stride past E (a slice of a bigger cache).
    k = torch.randn(B, K, S + 5, E, generator=g)[:, :, :S]
    v = torch.randn(B, K, S + 5, E, generator=g)[:, :, :S]
    q = torch.randn(B, H, 1, E, generator=g)
    term = None
    if term_kind == "bias":
        term = torch.randn(B, H, 1, S, generator=g)
        term = term.masked_fill(torch.rand(B, H, 1, S, generator=g) < 0.3, float("-inf"))
        term[..., 0] = 0.0  # every query sees a key (as in any cached step)
    elif term_kind == "mask":
        term = torch.zeros(B, 1, 1, S).masked_fill(torch.rand(B, 1, 1, S, generator=g) < 0.3, float("-inf"))
        term[..., 0] = 0.0
    cut = None if term is None else term[..., :n]
    want = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=cut, scale=0.3, enable_gqa=H != K)
    got = kernel.decode_attention(q, k, v, term, n, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused(kernel):
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="bad heads or length"):
        kernel.decode_attention(q, k, k, None, 9, 1.0)  # n past the cache
    with pytest.raises(RuntimeError, match="one query per row"):
        kernel.decode_attention(torch.randn(1, 2, 2, 16), k, k, None, 4, 1.0)


def spy_on(kernel, monkeypatch) -> list[str]:
    """Route fast/attention.py's kernels through a spy; returns the list each decode call appends to."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            if name == "decode_attention":
                calls.append(name)
            return getattr(kernel, name)

    monkeypatch.setattr(attention, "kernels", lambda: Spy())
    return calls


@torch.inference_mode()
def test_a_cached_decode_step_uses_the_kernel(kernel, monkeypatch, python_kernel):
    import torchformer as tfm

    calls = spy_on(kernel, monkeypatch)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64)
    net = tfm.build_model(cfg).eval()
    ids = torch.randint(0, 97, (2, 7))
    out = tfm.generate(net, ids, max_new_tokens=5)
    assert len(calls) == 2 * 4  # two layers, four decode steps (the fifth token needs no step)
    monkeypatch.setattr(attention, "kernels", lambda: None)  # SDPA over the prefix instead
    assert torch.equal(out, tfm.generate(net, ids, max_new_tokens=5))


@pytest.mark.parametrize("E, Ev, gap", [(64, 64, 8), (32, 48, 0), (24, 16, 4)])
def test_decode_kernel_with_spaced_keys_or_another_value_width(kernel, E, Ev, gap):
    """Keys not contiguous (a slot stride past the head width), and values of another width
    (as latent attention's): the prefetch walk and the generic loop still read the right slots."""
    g = torch.Generator().manual_seed(E + Ev + gap)
    B, H, K, S, n = 3, 4, 2, 50, 37
    k = torch.randn(B, K, S, E + gap, generator=g)[..., :E]
    v = torch.randn(B, K, S, Ev + gap, generator=g)[..., :Ev]
    q = torch.randn(B, H, 1, E, generator=g)
    term = torch.randn(B, H, 1, S, generator=g)
    want = F.scaled_dot_product_attention(
        q, k[:, :, :n], v[:, :, :n], attn_mask=term[..., :n], scale=0.2, enable_gqa=True
    )
    torch.testing.assert_close(kernel.decode_attention(q, k, v, term, n, 0.2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B, H, K, E, S, n", [s for s in SHAPES if s[3] <= 128])
@pytest.mark.parametrize("term_kind", ["bias", "none"])
def test_decode_kernel_reads_a_bf16_cache_as_it_is(kernel, B, H, K, E, S, n, term_kind):
    """A bf16 model's cache: the kernel widens each key and value in registers, so it equals SDPA
    over the same bf16 values in fp32 (only the order of the sums differs)."""
    g = torch.Generator().manual_seed(B * 100 + E + n + 1)
    k = torch.randn(B, K, S + 5, E, generator=g).bfloat16()[:, :, :S]
    v = torch.randn(B, K, S + 5, E, generator=g).bfloat16()[:, :, :S]
    q = torch.randn(B, H, 1, E, generator=g)
    term = None
    if term_kind == "bias":
        term = torch.randn(B, H, 1, S, generator=g)
        term = term.masked_fill(torch.rand(B, H, 1, S, generator=g) < 0.3, float("-inf"))
        term[..., 0] = 0.0
    cut = None if term is None else term[..., :n]
    want = F.scaled_dot_product_attention(
        q, k[:, :, :n].float(), v[:, :, :n].float(), attn_mask=cut, scale=0.3, enable_gqa=H != K
    )
    got = kernel.decode_attention(q, k, v, term, n, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Through the op's CPU kernel, with a bf16 query as a bf16 model has: one bf16 rounding of the result.
    qb = q.bfloat16()
    routed = attention.prefix_attention(qb, k, v, term, torch.tensor(n), 0.3)
    assert routed.dtype == torch.bfloat16
    want_b = kernel.decode_attention(qb.float(), k, v, term, n, 0.3).bfloat16()  # checked against SDPA above
    torch.testing.assert_close(routed, want_b, rtol=0, atol=0)
    if term is not None:  # a bf16 term (a bf16 model's mask), a strided view: widened as it is read
        tb = torch.zeros(B, H, 1, S + 3, dtype=torch.bfloat16)[..., 2 : S + 2].copy_(term)
        routed = attention.prefix_attention(qb, k, v, tb, torch.tensor(n), 0.3)
        want_t = kernel.decode_attention(qb.float(), k, v, tb.float(), n, 0.3).bfloat16()
        torch.testing.assert_close(routed, want_t, rtol=0, atol=0)


def test_a_bf16_cache_the_kernel_cannot_take_goes_to_sdpa(kernel):
    """Heads wider than the register path (E = 160): the kernel refuses bf16 there, and the op's
    kernel never sends it (SDPA over the prefix instead)."""
    q, k = torch.randn(1, 2, 1, 160), torch.randn(1, 2, 8, 160).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 keys and values need"):
        kernel.decode_attention(q, k, k, None, 4, 1.0)
    assert not attention.decodes(q.bfloat16(), k, k, None)
    out = attention.prefix_attention(q.bfloat16(), k, k, None, torch.tensor(4), 1.0)
    want = F.scaled_dot_product_attention(q.bfloat16(), k[:, :, :4], k[:, :, :4], scale=1.0)
    torch.testing.assert_close(out, want)


@torch.inference_mode()
def test_a_bf16_model_decodes_through_the_kernel(kernel, monkeypatch, python_kernel):
    import torchformer as tfm

    calls = spy_on(kernel, monkeypatch)
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64)
    torch.manual_seed(0)
    net = tfm.build_model(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 7))
    out = tfm.generate(net, ids, max_new_tokens=5)
    assert len(calls) == 2 * 4  # two layers, four decode steps, all on the bf16 cache
    monkeypatch.setattr(attention, "kernels", lambda: None)  # SDPA over the prefix instead
    # SDPA over the prefix instead: a decode step's logits agree within bf16 roundings of the
    # same sums (kernel: fp32 sums of the bf16 values, rounded once; SDPA: its own order).
    cache = net.new_cache(2, 16)
    pos = torch.arange(7)[None].expand(2, -1)
    net.logits(ids, pos, None, cache)
    step_ids, step_pos = out[:, 7:8], torch.full((2, 1), 7)
    monkeypatch.setattr(attention, "kernels", lambda: kernel)
    fast = net.logits(step_ids, step_pos, None, cache)
    monkeypatch.setattr(attention, "kernels", lambda: None)
    plain = net.logits(step_ids, step_pos, None, cache)
    torch.testing.assert_close(fast.float(), plain.float(), rtol=0.05, atol=0.05)


def op_cases():
    """(q, k, v, term, n) the op takes: decode steps over fp32 and bf16 caches with each kind of
    term, a chunk of 3 queries (SDPA over the prefix), a bf16 head too wide for the kernel."""
    g = torch.Generator().manual_seed(11)
    for B, H, K, E, S, n in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and E > 128:
                continue
            k = torch.randn(B, K, S + 5, E, generator=g).to(dtype)[:, :, :S]
            v = torch.randn(B, K, S + 5, E, generator=g).to(dtype)[:, :, :S]
            bias = torch.randn(B, H, 1, S, generator=g).to(dtype)
            for term in (None, bias):
                yield torch.randn(B, H, 1, E, generator=g).to(dtype), k, v, term, n
    k = torch.randn(2, 2, 12, 16, generator=g)
    yield torch.randn(2, 4, 3, 16, generator=g), k, k, torch.zeros(2, 1, 3, 12), 9
    wide = torch.randn(1, 2, 8, 160, generator=g).bfloat16()
    yield torch.randn(1, 2, 1, 160, generator=g).bfloat16(), wide, wide, None, 4


def test_the_ops_cpp_kernel_equals_its_python_one(kernel):
    attention.native(True)
    for q, k, v, term, n in op_cases():
        got = torch.ops.torchformer.prefix_sdpa(q, k, v, term, torch.tensor(n), 0.3)  # the C++ kernel
        assert torch.equal(got, attention.prefix_attention(q, k, v, term, torch.tensor(n), 0.3))


@torch.inference_mode()
def test_a_generation_scope_registers_the_cpp_kernel_and_it_can_be_given_back(kernel):
    import torchformer as tfm

    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64)
    net = tfm.build_model(cfg).eval()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    assert not attention.native(False) and attention.CPU_KERNEL is not None
    out = tfm.generate(net, ids, max_new_tokens=5)
    assert attention.CPU_KERNEL is None  # the scope registered the C++ kernel
    assert not attention.native(False)
    assert attention.CPU_KERNEL is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "native", lambda on=True: False)
        assert torch.equal(out, tfm.generate(net, ids, max_new_tokens=5))  # the Python kernel throughout
