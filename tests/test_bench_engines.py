"""benchmarks/engines.py's pure helpers: the same prompts everywhere, the padded tokenizer, the
table's arithmetic, and a clean exit when llama.cpp is not installed (`make bench` skips it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import engines


def test_prompts_are_the_same_in_every_process_and_skip_special_ids():
    a = engines.prompt_ids(8, 64, 1000)
    assert a == engines.prompt_ids(8, 64, 1000)
    assert len(a) == 8 and {len(r) for r in a} == {64}
    assert min(min(r) for r in a) >= 4 and max(max(r) for r in a) < 1000
    assert a[0] != a[1]  # rows differ
    assert engines.prompt_ids(1, 64, 1000) != a[:1]  # and so do batch sizes


def test_agreement_counts_the_shared_prefix():
    assert engines.agreement([1, 2, 3], [1, 2, 4]) == 2
    assert engines.agreement([1, 2], [1, 2, 3]) == 2
    assert engines.agreement([5], [1]) == 0


def test_best_and_ratio():
    samples = [{"t": 3.0}, {"t": 5.0}, {"t": None}]
    assert engines.best(samples, "t", higher=True) == 5.0
    assert engines.best(samples, "t", higher=False) == 3.0
    assert engines.best([], "t", higher=True) is None
    assert engines.ratio(8.0, 10.0) == "0.80x"
    assert engines.ratio(None, 10.0) == "-"


def test_file_rows_give_the_per_round_ratios_beside_the_best():
    """Issue 29's rows on a noisy machine: beside the ratio of the best rounds, the ratios of each round's
    pair (the file's worker and its own format's, measured in the same round), their median and range."""

    def row(system, speeds):
        samples = [{"batches": {"1": {"tok_s": t}}} for t in speeds]
        return {"system": system, "format": "int4", "engine": "torchformer", "samples": samples}

    own = row("torchformer int4 g64 compiled", [10.0, 20.0, 40.0])
    file = row("torchformer Q4_0-file compiled", [9.0, 22.0, 20.0])
    assert engines.paired(file, own, 1) == " (per round: median 0.90x, 0.50-1.10)"
    assert engines.paired(row("a", [9.0]), row("b", [10.0]), 1) == ""  # one round: no spread to show
    assert engines.paired(row("a", [9.0, None]), row("b", [10.0, 5.0]), 1) == ""  # a missing cell drops its round


def test_each_row_says_the_lowest_load_its_rounds_ran_at():
    """llama.cpp's spinning threads collapse under contention: a row shows the load it ran at, the
    lowest over its rounds, next to its best speed."""

    def row(system: str, engine: str, speeds: list[float], loads: list[float]) -> dict:
        samples = [{"batches": {"1": {"prefill_ms": 10.0, "tok_s": v, "steady_tok_s": v, "tokens": [1, 2]}},
                    "rss_mb": 100.0, "load": ld} for v, ld in zip(speeds, loads)]  # fmt: skip
        return {"system": system, "format": "int8", "engine": engine, "bytes": 1e6, "warmup_s": 1.0, "samples": samples}

    rows = [row("torchformer int8 compiled", "torchformer", [90.0, 100.0], [3.25, 1.5]),
            row("llama.cpp Q8_0", "llama.cpp", [50.0, 200.0], [6.75, 2.5])]  # fmt: skip
    args = engines.parse(["--batches", "1", "--prompts", "64"])
    lines = engines.engine_table(rows, bound=10.0, args=args).splitlines()
    assert lines[0].endswith("| load |")
    ours, theirs = lines[2], lines[3]
    assert ours.endswith("| 1.5 |") and "| 100.0 | 0.50x |" in ours
    assert theirs.endswith("| 2.5 |") and "| 200.0 |" in theirs


def test_decode_rates_and_the_steady_one_after_the_first_tokens():
    """A call's prefill is its first token's time, its decode rate the tokens after that over their
    time, its steady rate the same after the first WARM_TOKENS decoded tokens (the first ones after
    an idle spell re-read weights the host's L3 lost); too few tokens give no steady rate."""
    w = engines.WARM_TOKENS
    times = [1.0 + 0.5 * i for i in range(w + 1)] + [1.0 + 0.5 * w + 0.1 * i for i in range(1, 11)]
    prefill, tok_s, steady = engines.rates(0.5, times, times[-1], rows=2)
    assert prefill == 0.5
    assert abs(tok_s - (len(times) - 1) * 2 / (times[-1] - 1.0)) < 1e-9
    assert abs(steady - 10 * 2 / 1.0) < 1e-9  # the 10 tokens after the slow ones, 0.1 s each
    assert engines.rates(0.0, times[: 2 * w], times[2 * w - 1], rows=1)[2] is None


def test_padded_tokenizer_has_every_id_and_still_round_trips():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    text = "def f(x):\n    return x + 1\n" * 50
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([text], trainer)
    raw = json.loads(tok.to_str())
    engines.pad_merges(raw["model"]["vocab"], raw["model"]["merges"], sorted(alphabet), 1000)
    padded = tokenizers.Tokenizer.from_str(json.dumps(raw))
    assert padded.get_vocab_size() == 1000
    assert sorted(padded.get_vocab().values()) == list(range(1000))  # ids are dense: any id the model emits is text
    assert all(padded.decode([i]) for i in range(1000))
    assert padded.decode(padded.encode(text).ids) == text


def test_without_llama_cpp_it_says_how_to_install_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    assert engines.main(["--shapes", "toy", "--no-write"]) == 0
    assert "make bench-engines" in capsys.readouterr().out


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        engines.parse(["--formats", "fp8"])
    args = engines.parse(["--shapes", "toy", "--formats", "int8,int4", "--rounds", "1"])
    assert args.shapes == ["toy"] and args.formats == ["int8", "int4"] and args.rounds == 1


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    """llama.cpp runs without its extra buffer types only where the CPU has AMX (its AMX product
    segfaults on quantized files in this build); a missing cpuinfo is no AMX."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n")
    assert engines.cpu_has_amx(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni avx512_bf16\nbugs\t\t: amx_int8\n")
    assert not engines.cpu_has_amx(str(info))
    assert not engines.cpu_has_amx(str(tmp_path / "missing"))


def test_importing_the_benchmark_loads_no_torch():
    """The peers' workers run this module: torch loaded there would count in their peak RSS (it added
    ~300-430 MB to llama.cpp's when cpu_has_amx read the flags through torchformer)."""
    code = "import sys, benchmarks.engines; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_a_step_reads_come_from_the_panels_without_building_portable_copies(monkeypatch, tied):
    """torch_streamed_bytes once went through state_dict, whose panel modules build their portable
    copies: ~2 GB of temporaries in the 1B shape's measured peak RSS. Expected, from the shapes: the
    int4 panels (16-output panels of K/8 lines of 4 bytes, an fp32 scale per group and lane), their
    fp32 biases, and the float parameters but the input table (the head, tied or not, is its own
    quantized copy: a step reads that, not the table)."""
    import torchformer as tfm
    from tests.grid import build, variants
    from torchformer.fast import formats

    v = next(v for v in variants(("decoder",)) if (not v["bias"]) == tied)
    model = tfm.quantize(build(v), "int4", group_size=16)
    quantized = [m for m in model.modules() if isinstance(m, formats.PanelLinear)]
    if not quantized:
        pytest.skip("the CPU kernels are not built here (TORCHFORMER_NATIVE=0 or no AVX2)")

    def built(self):
        raise AssertionError("a portable copy was built")

    monkeypatch.setattr(formats.PanelLinear, "portable", built)
    k8, groups = (lambda m: m.in_features // 8), (lambda m: m.in_features // 16)
    panels = sum(-(-m.out_features // 16) * 16 * (4 * k8(m) + 4 * groups(m)) for m in quantized)
    biases = sum(4 * m.out_features for m in quantized if m.bias is not None)
    assert biases > 0 if not tied else biases == 0  # the grid's bias rows are its untied ones
    floats = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed.tok.weight")
    assert model.lm_head in quantized
    assert engines.torch_streamed_bytes(model) == panels + biases + floats


@pytest.mark.parametrize("compiled", [False, True])
def test_the_kv_cache_bytes_are_those_generate_allocates(compiled):
    """The memory note's KV term: the cache generate makes for a batch (bucketed when compiled),
    counted without allocating it, equal to the bytes of the cache steps.prefill allocates."""
    import torch

    import torchformer as tfm
    from torchformer.generation.request import make_request
    from torchformer.generation.steps import prefill

    cfg = tfm.ModelConfig(vocab_size=50, d_model=32, n_layers=2, max_seq_len=600,
                          attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=2), positions=tfm.RoPE())  # fmt: skip
    model = tfm.build_model(cfg).eval().to(torch.bfloat16)
    runner = engines.Torchformer.__new__(engines.Torchformer)
    runner.model, runner.compile = model, compiled
    ids = torch.randint(0, 50, (3, 20))
    req = make_request(model, ids, max_new_tokens=9, attention_mask=None, eos_token_id=None)
    with torch.no_grad():
        cache = prefill(model, req, bucketed=compiled).cache
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
    assert runner.cache_bytes(3, 20 + 9 - 1) == held
    # 2 layers x (k, v) x 2 KV heads x 8 wide x 3 rows x 2 bytes a position: 28 positions (+1 hidden)
    # eager, the bucket of 256 (+1) compiled
    assert held == 2 * 2 * 2 * 8 * 3 * 2 * (257 if compiled else 29)


def test_the_memory_note_subtracts_weights_and_cache_from_the_peak():
    sample = {"batches": {}, "rss_mb": 1000.0, "load": 1.0, "held_mb": 600.0, "kv_mb": 64.0}
    ours = [sample, {**sample, "rss_mb": 990.0}]  # the highest of the rounds counts
    rows = [{"system": "torchformer bf16 compiled", "engine": "torchformer", "samples": ours},
            {"system": "llama.cpp F16", "engine": "llama.cpp", "samples": [{"rss_mb": 900.0}]}]  # fmt: skip
    (note,) = engines.memory_notes(rows)
    assert note.endswith("torchformer bf16 compiled 336 (weights 600, KV cache 64)") and "target <= 286" in note
    ours[1]["inductor"] = True  # a round whose worker compiled a step: said, its imports count
    (note,) = engines.memory_notes(rows)
    assert note.endswith("336 (weights 600, KV cache 64, inductor imported: a step compiled here)")


@pytest.mark.parametrize("shape", ["toy", "1b"])
def test_the_bound_reads_the_bf16_models_streamed_bytes(shape):
    """The bound worker starts before any model loads: its byte count, from the shape's numbers,
    equals torch_streamed_bytes of the shape's bf16 model (built on the meta device, no memory)."""
    import torch

    import torchformer as tfm

    s = engines.SHAPES[shape]
    cfg = tfm.ModelConfig(vocab_size=s["vocab"], d_model=s["hidden"], n_layers=s["layers"], max_seq_len=64,
                          attention=tfm.AttentionConfig(n_heads=s["heads"], n_kv_heads=s["kv_heads"], bias=False),
                          block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu", d_ff=s["d_ff"], bias=False),
                          positions=tfm.RoPE(), tie_embeddings=s["tied"])  # fmt: skip
    with torch.device("meta"):
        model = tfm.build_model(cfg).to(torch.bfloat16)
    assert engines.bf16_streamed_bytes(shape) == engines.torch_streamed_bytes(model)


@pytest.mark.parametrize("shape", ["toy", "1b"])
def test_a_steps_kv_bytes_are_one_position_of_the_shapes_bf16_cache_per_key(shape):
    """The KV term of the bytes a step reads: per key and row, one position of the cache the shape's
    bf16 model allocates (new_cache of one row, two lengths: the difference is one position)."""
    import torch

    import torchformer as tfm

    s = engines.SHAPES[shape]
    cfg = tfm.ModelConfig(vocab_size=64, d_model=s["hidden"], n_layers=s["layers"], max_seq_len=64,
                          attention=tfm.AttentionConfig(n_heads=s["heads"], n_kv_heads=s["kv_heads"], bias=False),
                          block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu", d_ff=64, bias=False),
                          positions=tfm.RoPE())  # fmt: skip
    with torch.device("meta"):
        model = tfm.build_model(cfg).to(torch.bfloat16)

    def held(length):
        cache = model.new_cache(1, length)
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))

    assert engines.kv_bytes_per_key(shape) == held(9) - held(8)


def test_the_mean_keys_are_those_of_the_steps_each_rate_counts():
    """Decode step i (i = 1 .. n - 1) makes token i from the token before, at position prompt + i - 1,
    so it attends over prompt + i keys; the steady rate counts the steps after WARM_TOKENS (rates)."""
    prompt, n, w = 64, 48, engines.WARM_TOKENS
    keys = [prompt + i for i in range(1, n)]
    got = engines.decode_keys(prompt, n)
    assert got["tok_s"] == pytest.approx(sum(keys) / len(keys))
    assert got["steady_tok_s"] == pytest.approx(sum(keys[w:]) / len(keys[w:]))
    row = {"bytes": 1e6, "kv_per_key": 100, "keys": got}
    assert engines.read_bytes(row, 8) == pytest.approx(1e6 + 8 * 100 * sum(keys) / len(keys))
    assert engines.read_bytes(row, 8, weights_only=True) == 1e6
    # of bound counts both: 10 steps/s of 1e6 + 8,800 bytes against a bound of 1 GB/s
    sample = {"batches": {"1": {"tok_s": 10.0}}, "bound": 1.0}
    assert engines.of_bound({**row, "samples": [sample]}, 1, 99.0) == pytest.approx((1e6 + 8800) * 10 / 1e9)
    assert engines.of_bound({**row, "samples": [sample]}, 1, 99.0, weights_only=True) == pytest.approx(0.01)


def test_of_bound_pairs_each_round_with_its_own_reading():
    """A row read in a slow spell is held against the bound read in that spell: the median of the
    per-round fractions, not the best speed over the best bound."""

    def sample(tok_s, bound):
        return {"batches": {"1": {"tok_s": tok_s}}, "bound": bound}

    row = {"bytes": 1e9, "samples": [sample(10.0, 20.0), sample(20.0, 25.0), sample(12.0, 12.0)]}
    assert engines.of_bound(row, 1, bound=99.0) == pytest.approx(0.8)  # 0.5, 0.8, 1.0
    assert engines.of_bound({"bytes": 1e9, "samples": [{"batches": {"1": {"tok_s": 5.0}}}]}, 1, 10.0) == 0.5


def test_each_rows_turn_is_held_against_the_bound_read_just_before_and_after_it(monkeypatch, tmp_path):
    """measure_format reads the bound before each worker's turn and after the last: a sample keeps
    the two readings around it and their mean, so a row is compared with the host's bandwidth of
    its own minute, not of the round's end."""
    readings = iter([10.0, 20.0, 40.0, 12.0, 16.0, 18.0])  # two rounds of two workers: three readings each

    class Bound:
        def ask(self, what):
            return {"bound": next(readings)}

    class Fake:
        def __init__(self, name, spec, logs):
            self.name = name

        def read(self):
            return {"bytes": 1e9, "load_s": 0.0}

        def ask(self, what):
            return {"batches": {"1": {"tok_s": 1.0}}}

        def stop(self):
            pass

    monkeypatch.setattr(engines, "worker_specs", lambda *a: [("a", {"system": "torchformer"}), ("b", {"system": "x"})])
    monkeypatch.setattr(engines, "Worker", Fake)
    args = type("Args", (), {"rounds": 2, "prompts": [64], "new_tokens": 48})()
    rows = engines.measure_format("toy", "bf16", args, tmp_path, {}, tmp_path, Bound())
    assert rows[0]["kv_per_key"] == engines.kv_bytes_per_key("toy") and rows[0]["keys"]["tok_s"] == 64 + 24
    assert [[s["readings"] for s in r["samples"]] for r in rows] == [[[10.0, 20.0], [12.0, 16.0]],
                                                                     [[20.0, 40.0], [16.0, 18.0]]]  # fmt: skip
    assert [[s["bound"] for s in r["samples"]] for r in rows] == [[15.0, 14.0], [30.0, 17.0]]
