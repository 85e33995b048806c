"""torchformer against the CPU engines people pick instead (issue 25): llama.cpp (llama-cpp-python,
built from its sdist) and CTranslate2, format for format, on the decode benchmark's toy shape and
the Llama-3.2-1B shape.

Models: random weights written by transformers in bf16 (a LlamaConfig, `save_pretrained`) with a
byte-level BPE tokenizer trained here on the standard library's sources (padded with extra merges
to the model's vocabulary, so every id decodes to text on every engine). llama.cpp gets that folder
converted to GGUF f16 by the `convert_hf_to_gguf.py` shipped inside its sdist, then Q8_0, Q4_0 and
Q4_K_M by `llama_model_quantize` through the binding; CTranslate2 by its own converter. Everything
is kept in benchmarks/.cache (or --cache) and reused.

Formats, format for format: 16-bit (our bf16 folder / llama.cpp F16; CTranslate2 refuses 16-bit
compute on this CPU), 8-bit (`tfm.quantize(m, "int8")` / Q8_0 / CTranslate2 int8), 4-bit
(`tfm.quantize(m, "int4")` / Q4_0, and Q4_K_M reported). Each (system, format) runs in a worker
process of its own (a shared process would share compile caches and allocator state); the workers
of one format are alive together and measured in interleaved rounds, each cell keeping its best
round (noise only slows). Per batch size (1 and 8): prefill of the 64-token prompt + first token (ms), decode tokens/s
(greedy, EOS ignored), weights read per step and their GB/s against the machine's streaming bound
(benchmarks.decode.streaming_bound, measured in the same run), and the worker's peak RSS; prefill
of 512 tokens at batch 1. The serve mode drives `torchformer serve` and llama.cpp's own
`llama-server` (built from the same sdist) with streamed completions at concurrency 1, 4 and 8.

    make bench-engines                # installs llama-cpp-python / ctranslate2, then the full run
    python -m benchmarks.engines --shapes toy --rounds 1 --new-tokens 16 --skip-serve --no-write   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # pyproject's `engines` extra pins the same
INSTALL_HINT = (
    "llama-cpp-python is not installed: `make bench-engines` builds it from its sdist (~5 min on 2 cores) "
    "and runs this benchmark"
)
CACHE = Path(os.environ.get("TORCHFORMER_ENGINES_CACHE", Path(__file__).with_name(".cache")))
LLAMA_3_2_ROPE = {  # rope_scaling of the published Llama-3.2-1B config
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# The toy is benchmarks/decode.py's model with its int4 d_ff (1408 = 64 x 22; its 1368 has no
# power-of-two group, neither for our int4 nor for llama.cpp's 32-wide Q4_0 blocks), so one model
# serves every format. The 1B shape is Llama-3.2-1B's.
SHAPES = {
    "toy": dict(vocab=8192, hidden=512, layers=6, heads=8, kv_heads=8, d_ff=1408, tied=False, max_pos=2048,
                rope_theta=10000.0, rope_scaling=None),
    "1b": dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, d_ff=8192, tied=True, max_pos=131072,
               rope_theta=500000.0, rope_scaling=LLAMA_3_2_ROPE),
}
# format -> (our quantize scheme, llama.cpp types (the first is the one the ratio is against), CTranslate2 type)
FORMATS = {
    "bf16": (None, ("F16",), None),  # CTranslate2 refuses bfloat16 / float16 compute on this CPU
    "int8": ("int8", ("Q8_0",), "int8"),
    "int4": ("int4", ("Q4_0", "Q4_K_M"), None),
}
FORMAT_LABEL = {"bf16": "16-bit", "int8": "8-bit", "int4": "4-bit"}
LLAMA_FTYPES = {kind: f"LLAMA_FTYPE_MOSTLY_{kind}" for kind in ("Q8_0", "Q4_0", "Q4_K_M")}
MODES = ("eager", "compiled")
SERVE_LEVELS = (1, 4, 8)
RESULT = "ENGINES-RESULT "  # prefix of a worker's answer line (engines log freely to stdout/stderr)


# --- pure helpers (tests/test_bench_engines.py) ----------------------------------------------------
def prompt_ids(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The same random prompts for every engine; ids >= 4 skip the tokenizer's special tokens."""
    import random

    rng = random.Random(seed * 1000 + batch * 100 + length)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(batch)]


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def best(samples: list[dict], key: str, higher: bool) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    if not values:
        return None
    return max(values) if higher else min(values)


def pad_merges(vocab: dict[str, int], merges: list, alphabet: list[str], size: int) -> None:
    """Grow a byte-level BPE (vocab, merges) to ``size`` tokens in place with merges of each token
    and one more byte symbol, lowest priority: a valid BPE that still tokenizes text as trained,
    and a vocabulary where every id the model can emit is text (random weights emit any id)."""
    bases = sorted(vocab, key=vocab.get)
    for base in bases:
        for ch in alphabet:
            if len(vocab) >= size:
                return
            if base + ch not in vocab:
                vocab[base + ch] = len(vocab)
                merges.append([base, ch])
    if len(vocab) < size:
        pad_merges(vocab, merges, alphabet, size)  # longer tokens from the ones just added


def ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


# --- the models on disk ----------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[engines] {msg}", file=sys.stderr, flush=True)


def byte_level_bpe(texts, vocab: int, trained: int, specials: list[str]) -> dict:
    """tokenizer.json's content: a byte-level BPE of ``trained`` tokens learnt from ``texts``,
    padded with merges to ``vocab`` (pad_merges). Also the GGUF tests' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=trained, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    raw = json.loads(tok.to_str())
    pad_merges(raw["model"]["vocab"], raw["model"]["merges"], sorted(alphabet), vocab)
    return raw


def train_tokenizer(folder: Path, vocab: int) -> None:
    """tokenizer.json (byte-level BPE, 8192 merges learnt from the stdlib, padded to ``vocab``)."""
    from benchmarks.serve import corpus

    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    (folder / "tokenizer.json").write_text(json.dumps(byte_level_bpe(corpus(), vocab, min(vocab, 8192), specials)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hf_folder(shape: str, cache: Path) -> Path:
    """The HF Llama folder of ``shape`` in bf16 with its tokenizer; made once, then reused."""
    folder = cache / shape / "hf"
    if (folder / ".complete").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    s = SHAPES[shape]
    log(f"writing the {shape} HF folder (random bf16 weights) to {folder}")
    cfg = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["d_ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], tie_word_embeddings=s["tied"],
        max_position_embeddings=s["max_pos"], rope_theta=s["rope_theta"], rope_scaling=s["rope_scaling"],
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,  # no EOS: every engine generates the full length
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # bf16 from the start: no fp32 copy of 1B
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    train_tokenizer(folder, s["vocab"])
    (folder / ".complete").touch()
    return folder


def llama_source(cache: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (its converter, gguf-py and server sources).
    Fetched and unpacked once, under a lock and into a temporary folder renamed into place: test
    workers and benchmark processes call this at the same time, and one that found a half-unpacked
    tree imported the installed gguf package instead of the sdist's (a failure seen in CI)."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    done = root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if done.exists():
        return done.parent
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".llama_source.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if done.exists():  # another process unpacked it while this one waited
            return done.parent
        sdist = cache / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
        if not sdist.exists():
            log("downloading the llama-cpp-python sdist (for its converter and server sources)")
            with tempfile.TemporaryDirectory(dir=cache) as part:
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", part],
                    check=True,
                )  # fmt: skip
                os.replace(Path(part) / sdist.name, sdist)
        shutil.rmtree(root, ignore_errors=True)  # a tree left half-unpacked by a killed process
        with tempfile.TemporaryDirectory(dir=cache) as part:
            with tarfile.open(sdist) as tar:
                tar.extractall(part, filter="data")
            os.replace(Path(part) / root.name, root)
    return done.parent


# The converter identifies a BPE pre-tokenizer by hashing how the tokenizer splits a test string,
# and knows only published tokenizers; ours splits with GPT-2's byte-level regex, so it says so.
CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + '/gguf-py']
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv[0] = root + '/convert_hf_to_gguf.py'
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def gguf_file(shape: str, kind: str, cache: Path) -> Path:
    """cache/<shape>/gguf/model-<kind>.gguf: F16 by the sdist's converter, the others quantized from it."""
    out = cache / shape / "gguf" / f"model-{kind}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    if kind == "F16":
        src, root = hf_folder(shape, cache), llama_source(cache)
        log(f"converting {src} to GGUF f16 with the sdist's convert_hf_to_gguf.py")
        cmd = [sys.executable, "-c", CONVERT, str(root), str(src), "--outtype", "f16", "--outfile", str(tmp)]
        quiet(cmd, cache / "logs" / f"convert-{shape}.log", {"NO_LOCAL_GGUF": "1"})  # CONVERT puts its gguf-py first
    else:
        import ctypes

        import llama_cpp

        f16 = gguf_file(shape, "F16", cache)
        log(f"quantizing {f16.name} to {kind} with llama_model_quantize")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, LLAMA_FTYPES[kind])
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed (its log is above)")
    tmp.rename(out)
    return out


def gguf_streamed_bytes(path: Path, root: Path) -> int:
    """Bytes a one-token step reads: every tensor but the input embedding table (one row), unless
    there is no output matrix (tied) and the head reads that table."""
    sys.path.insert(0, str(root / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def ct2_folder(shape: str, quantization: str, cache: Path) -> Path:
    out = cache / shape / f"ct2-{quantization}"
    if not (out / "model.bin").exists():
        log(f"converting the {shape} folder for CTranslate2 ({quantization})")
        cmd = ["ct2-transformers-converter", "--model", str(hf_folder(shape, cache)), "--output_dir", str(out),
               "--quantization", quantization, "--force"]  # fmt: skip
        quiet([str(Path(sys.executable).with_name(cmd[0])), *cmd[1:]], cache / "logs" / f"ct2-{shape}.log")
        # CTranslate2 will not load a model without named BOS/EOS tokens, and ours has none on purpose
        # (every engine generates the full length): name the first special token; decoding ignores it.
        config = json.loads((out / "config.json").read_text())
        for key in ("bos_token", "eos_token"):
            config[key] = config[key] or "<|endoftext|>"
        (out / "config.json").write_text(json.dumps(config))
    return out


def quiet(cmd: list[str], logfile: Path, env: dict | None = None) -> None:
    """Run a chatty tool with its output in ``logfile``; its tail is in the error when it fails."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {logfile.read_text()[-1500:]}")


# --- the workers: one process per (system, format) -------------------------------------------------
def resident_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident set in MB: VmHWM, its memory's high-water mark, which starts afresh
    at exec. Not ru_maxrss: a child starts with its parent's at fork and keeps it across exec, so
    every worker of a run whose parent had built the 1B model in-process reported the parent's
    3342 MB (2026-12-04)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


class Torchformer:
    """tfm.load_any of the HF folder (bf16 as stored), quantized as it is read for int8 / int4."""

    def __init__(self, spec: dict) -> None:
        import torch

        import torchformer as tfm

        torch.set_num_threads(spec["threads"])
        self.tfm, self.torch = tfm, torch
        # Quantized as it is read (tfm.load_any(..., quantize=)): the bf16 bytes are never all held.
        group = spec["group_size"] if spec["scheme"] == "int4" else None
        # bf16 as the folder stores it (a no-op cast there): 16-bit is measured, never an fp32 upcast.
        model = tfm.load_any(spec["folder"], dtype=torch.bfloat16, quantize=spec["scheme"] or None, group_size=group)
        self.note = ""
        self.model, self.compile = model, spec["mode"] == "compiled"
        self.bytes = torch_streamed_bytes(model)
        self.held = torch_held_bytes(model)  # the weights as held: the memory target's first term
        self.kv = 0  # bytes of the largest KV cache a call of this worker allocated

    def cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the cache ``generate`` allocates for ``batch`` rows needing ``length`` positions
        (rounded up to the compiled step's bucket, plus the hidden slot), counted from a 1-slot
        cache of the model's own layout, not allocated at full size."""
        from torchformer.generation.steps import cache_length

        one = self.model.new_cache(batch, 1)
        per_slot = sum(t.numel() * t.element_size() for layer in one.layers for t in (layer.k, layer.v)) // 2
        return per_slot * (cache_length(length, self.model.config.max_seq_len, self.compile) + 1)

    def generate(self, ids: list[list[int]], n: int) -> tuple[float, float, list[int]]:
        """(prompt forward + first token s, decode tokens/s, row 0's tokens)."""
        x = self.torch.tensor(ids)
        self.kv = max(self.kv, self.cache_bytes(len(ids), len(ids[0]) + n - 1))
        t0 = time.perf_counter()
        times, out = [], []
        for tok in self.tfm.stream(self.model, x, max_new_tokens=n, compile=self.compile):
            times.append(time.perf_counter())
            # row 0's token as an int, read as llama.cpp's sampler hands its ints over: tolist()
            # copies the values out; int(tok[0]) first makes a view through torch's indexing,
            # whose code a step had evicted (toy int4: ~10 us more a token, 2026-12-07)
            out.append(tok.tolist()[0])
        return rates(t0, times, time.perf_counter(), len(ids)) + (out,)

    def prefill(self, ids: list[list[int]], n: int) -> float:
        """The first token of a generate call sized like the others (a compiled step is never
        reached, so a long prompt compiles nothing)."""
        self.kv = max(self.kv, self.cache_bytes(len(ids), len(ids[0]) + n - 1))
        t0 = time.perf_counter()
        tokens = self.tfm.stream(self.model, self.torch.tensor(ids), max_new_tokens=n, compile=self.compile)
        next(tokens)
        elapsed = time.perf_counter() - t0
        tokens.close()
        return elapsed


def torch_held_bytes(model) -> int:
    """Bytes of the model's weights as held: its parameters (tied ones once), the quantized
    projections' buffers (the kernels' panels and scales) and a token table a GGUF file keeps mapped
    (interop/gguf/table.py: its rows as stored). Counted from the modules' own tensors, never through
    state_dict: a panel module's state_dict builds its portable copy (fast/quant_panels.py), which
    put ~2 GB of temporaries into the 1B shape's measured peak RSS."""
    from torchformer.nn.quant import QuantLinear

    held = {id(t): t for t in model.parameters()}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            held.update((id(b), b) for b in m.buffers(recurse=False) if b is not None)
    table = input_table(model)
    held[id(table)] = table
    return sum(t.numel() * t.element_size() for t in held.values())


def input_table(model):
    """The input embedding's stored table: its weight, or the file's rows a mapped GGUF table reads."""
    tok = model.embed.tok
    return tok.raw if hasattr(tok, "raw") else tok.weight


def torch_streamed_bytes(model) -> int:
    """Bytes a one-token step reads: the weights held, less the input embedding table unless the
    head reads it whole (tied; benchmarks.decode.streamed_bytes assumes an untied head)."""
    table = input_table(model)
    tied = getattr(model.lm_head, "weight", None) is table
    return torch_held_bytes(model) - (0 if tied else table.numel() * table.element_size())


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU advertises AMX int8 tiles (Linux; False where cpuinfo cannot be read).
    Read here, not through torchformer.fast.native.cpu_flags: this runs when the module is imported,
    also in the peers' workers, which must not load torch (~300-430 MB of their measured RSS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_int8" in flags


# llama-cpp-python 0.3.36 built with GGML_NATIVE segfaults in ggml's AMX product
# (ggml_backend_amx_mul_mat) on every quantized GGUF on a CPU with AMX, so there llama.cpp runs
# without its extra buffer types (the AMX and the CPU runtime weight repacking): the binding's
# use_extra_bufts False, llama-server's --no-repack. Elsewhere it keeps them (its faster path).
NO_REPACK = cpu_has_amx()
NO_REPACK_NOTE = (
    "llama.cpp ran without its extra buffer types (no AMX and no runtime weight repacking: binding "
    "use_extra_bufts=False, llama-server --no-repack) because this CPU has AMX and ggml's AMX product "
    "segfaults on quantized GGUFs in this build"
)


class LlamaCpp:
    """llama.cpp through the binding's C API: one context with ``batch`` sequences (the high-level
    ``Llama`` class decodes one), greedy by llama.cpp's own sampler, EOS never checked."""

    def __init__(self, spec: dict) -> None:
        import llama_cpp as L

        self.L, self.threads = L, spec["threads"]
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        if NO_REPACK:
            mparams.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(spec["gguf"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
        self.max_batch, self.per_seq = max(spec["batches"]), spec["context"]
        cparams = L.llama_context_default_params()
        cparams.n_seq_max = self.max_batch
        cparams.n_ctx = self.max_batch * self.per_seq
        # One llama_decode per prefill: the longest prompt alone, or every row's first prompt together.
        cparams.n_batch = cparams.n_ubatch = max(max(spec["prompts"]), self.max_batch * spec["prompts"][0])
        cparams.n_threads = cparams.n_threads_batch = self.threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(cparams.n_batch, 0, 1)  # each token belongs to one sequence
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        self.sampler, self.n_batch = chain, cparams.n_batch
        self.note = (
            f"KV cache {kv_type_name(L, cparams.type_k)}/{kv_type_name(L, cparams.type_v)}, flash attention "
            f"{flash_attn_name(cparams)}, n_batch {cparams.n_batch}, load mode {load_mode_name(mparams)}"
            + (f"; {NO_REPACK_NOTE}" if NO_REPACK else "")
        )
        self.bytes = 0  # filled by the parent from the GGUF file

    def fill(self, rows: list[list[int]], start: int, want_logits: bool) -> None:
        """The batch holds each row's tokens from position ``start``; logits for rows' last tokens."""
        b, n = self.batch, 0
        for seq, tokens in enumerate(rows):
            for i, tok in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, start + i, 1
                b.seq_id[n][0] = seq
                b.logits[n] = want_logits and i == len(tokens) - 1
                n += 1
        b.n_tokens = n

    def step(self, rows: list[list[int]], start: int) -> list[int]:
        """Decode ``rows`` (the prompt chunk, or one token each) and pick each row's next token."""
        self.fill(rows, start, True)
        if self.L.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        ends = [sum(len(r) for r in rows[: i + 1]) - 1 for i in range(len(rows))]
        return [self.L.llama_sampler_sample(self.sampler, self.ctx, e) for e in ends]

    def reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def generate(self, ids: list[list[int]], n: int) -> tuple[float, float, list[int]]:
        self.reset()
        assert sum(map(len, ids)) <= self.n_batch, "the prompt batch must fit one llama_decode"
        t0 = time.perf_counter()
        nxt = self.step(ids, 0)
        times, out = [time.perf_counter()], [nxt[0]]
        for k in range(1, n):
            nxt = self.step([[t] for t in nxt], len(ids[0]) + k - 1)
            times.append(time.perf_counter())
            out.append(nxt[0])
        return rates(t0, times, time.perf_counter(), len(ids)) + (out,)

    def prefill(self, ids: list[list[int]], n: int) -> float:
        self.reset()
        t0 = time.perf_counter()
        self.step(ids, 0)
        return time.perf_counter() - t0


def kv_type_name(L, value: int) -> str:
    names = {getattr(L, f"GGML_TYPE_{t}", None): t.lower() for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0")}
    return names.get(value, str(value))


def load_mode_name(mparams) -> str:
    """How the weights are read in: this llama.cpp has load_mode (auto picks mmap on a CPU); older ones use_mmap."""
    if hasattr(mparams, "load_mode"):
        return {-1: "auto", 0: "none", 1: "mmap", 2: "mlock", 3: "mmap+mlock", 4: "direct I/O"}.get(
            mparams.load_mode, str(mparams.load_mode)
        )
    return "mmap" if getattr(mparams, "use_mmap", False) else "read"


def flash_attn_name(cparams) -> str:
    if hasattr(cparams, "flash_attn_type"):  # -1 auto, 0 off, 1 on
        return {-1: "auto", 0: "off", 1: "on"}.get(cparams.flash_attn_type, str(cparams.flash_attn_type))
    return "on" if getattr(cparams, "flash_attn", False) else "off"


class CTranslate2:
    """ctranslate2.Generator on the converted folder; prompts as the vocabulary's token strings."""

    def __init__(self, spec: dict) -> None:
        import ctranslate2
        from tokenizers import Tokenizer

        self.gen = ctranslate2.Generator(
            spec["ct2"], device="cpu", compute_type=spec["compute"], intra_threads=spec["threads"], inter_threads=1
        )
        tok = Tokenizer.from_file(str(Path(spec["folder"]) / "tokenizer.json"))
        self.strings = tok.id_to_token
        self.ids = tok.token_to_id
        self.note = f"compute type {self.gen.compute_type}"
        self.bytes = sum(f.stat().st_size for f in Path(spec["ct2"]).glob("model.bin"))

    def generate(self, ids: list[list[int]], n: int) -> tuple[float, float, list[int]]:
        prompts = [[self.strings(t) for t in row] for row in ids]
        if len(ids) == 1:  # streamed: the first token's time is the prefill
            t0, times, out = time.perf_counter(), [], []
            for step in self.gen.generate_tokens(prompts[0], max_length=n, sampling_topk=1, end_token=[]):
                times.append(time.perf_counter())
                out.append(step.token_id)
            return rates(t0, times, time.perf_counter(), 1) + (out,)
        pre = self.prefill(ids, n)
        t0 = time.perf_counter()
        res = self.gen.generate_batch(
            prompts, max_length=n, min_length=n, sampling_topk=1, include_prompt_in_result=False
        )
        total = time.perf_counter() - t0
        tok_s = (n - 1) * len(ids) / (total - pre) if total > pre else None  # a noisy prefill can exceed it
        return pre, tok_s, None, [self.ids(s) for s in res[0].sequences[0]]

    def prefill(self, ids: list[list[int]], n: int) -> float:
        prompts = [[self.strings(t) for t in row] for row in ids]
        t0 = time.perf_counter()
        self.gen.generate_batch(prompts, max_length=1, sampling_topk=1, include_prompt_in_result=False)
        return time.perf_counter() - t0


RUNNERS = {"torchformer": Torchformer, "llama.cpp": LlamaCpp, "ctranslate2": CTranslate2}


# Decode tokens after which a call's rate counts as steady (``rates``): the toy shape's weights lie in
# the host's shared L3, which other tenants' traffic empties of them while a worker idles or prefills,
# and the first tokens after read them back from DRAM. Measured (torchformer int4, a step bound to a
# warm cache, 2026-12-07): 20 ms of a Python loop, a 1-thread product or page faults before a decode
# added ~0.9-1.1 ms over its first 8 tokens (OMP_WAIT_POLICY=active: the same), none after.
WARM_TOKENS = 8


def rates(t0: float, times: list[float], end: float, rows: int) -> tuple[float, float, float | None]:
    """(prefill s, decode tok/s, steady decode tok/s) of one call from its start ``t0``, the time each
    new token (row 0's; a batch's step) was had, and its end: the prefill is the first token's
    time, decode the tokens after it over theirs, steady the tokens after the first WARM_TOKENS of
    those over theirs (None where there are too few)."""
    n = len(times)
    steady = (n - 1 - WARM_TOKENS) * rows / (end - times[WARM_TOKENS]) if n > 2 * WARM_TOKENS else None
    return times[0] - t0, (n - 1) * rows / (end - times[0]), steady


def measure_once(runner, spec: dict) -> dict:
    """One sample of every cell this worker owns."""
    out = {"batches": {}}
    for b in spec["batches"]:
        pre, tok_s, steady, tokens = runner.generate(
            prompt_ids(b, spec["prompts"][0], spec["vocab"]), spec["new_tokens"]
        )
        out["batches"][b] = {"prefill_ms": 1000 * pre, "tok_s": tok_s, "steady_tok_s": steady, "tokens": tokens[:16]}
    for length in spec["prompts"][1:]:  # longer prefills at batch 1
        out[f"prefill_{length}_ms"] = 1000 * runner.prefill(prompt_ids(1, length, spec["vocab"]), spec["new_tokens"])
    out["rss_mb"] = peak_rss_mb()
    if hasattr(runner, "held"):
        out["held_mb"], out["kv_mb"] = runner.held / 2**20, runner.kv / 2**20
        # A step compiled in this worker (not found in the step cache) imports inductor, whose
        # modules (~150 MiB of sympy, triton and its own) the peak then holds: said with the row.
        out["inductor"] = "torch._inductor.codecache" in sys.modules
    return out


def worker_main(spec: dict) -> int:
    """Answer the parent's commands on stdin ("warmup", "measure", "quit") with one result line each."""
    if spec["system"] == "bound":  # one plain read of the bytes per "measure", in the rounds beside the rows
        import torch

        from benchmarks.decode import streaming_reader

        torch.set_num_threads(spec["threads"])
        read = streaming_reader(spec["bytes"])
        print(RESULT + json.dumps({"load_s": 0.0, "bytes": spec["bytes"], "note": ""}), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            print(RESULT + json.dumps({"bound": read(10)}), flush=True)
        return 0
    t0 = time.perf_counter()
    runner = RUNNERS[spec["system"]](spec)
    hello = {"load_s": time.perf_counter() - t0, "bytes": runner.bytes, "note": runner.note}
    print(RESULT + json.dumps(hello), flush=True)
    for line in sys.stdin:
        op = line.strip()
        if op == "quit":
            break
        t0 = time.perf_counter()
        res = measure_once(runner, spec)
        res["seconds"] = time.perf_counter() - t0
        print(RESULT + json.dumps(res), flush=True)
    return 0


class Worker:
    """A worker process; its log goes to a file (llama.cpp and inductor are chatty)."""

    def __init__(self, name: str, spec: dict, logs: Path) -> None:
        self.name = name
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
        self.log = open(logs / (name.replace(" ", "_").replace("/", "-") + ".log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.engines", "worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
            cwd=Path(__file__).resolve().parent.parent, start_new_session=True,
        )  # fmt: skip

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        self.proc.wait()
        raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}); see {self.log.name}")

    def ask(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
        self.log.close()


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


# --- the parent: which workers, in which order -------------------------------------------------------
def engines_available(wanted: list[str]) -> dict[str, str]:
    """engine -> why it is skipped ('' when it runs)."""
    out = {}
    for name, module in (("llama.cpp", "llama_cpp"), ("ctranslate2", "ctranslate2")):
        if name in wanted:
            out[name] = "" if importlib.util.find_spec(module) else f"{module} is not installed"
    return out


def worker_specs(shape: str, fmt: str, args, cache: Path, skipped: dict) -> list[tuple[str, dict]]:
    """(row label, spec) of every worker measuring ``fmt`` on ``shape``."""
    s, (scheme, kinds, ct2_type) = SHAPES[shape], FORMATS[fmt]
    base = {"batches": args.batches, "prompts": args.prompts, "new_tokens": args.new_tokens, "vocab": s["vocab"],
            "threads": args.threads}  # fmt: skip
    folder = str(hf_folder(shape, cache))
    out = []
    label = {"bf16": "bf16", "int8": "int8", "int4": f"int4 g{args.group_size}"}[fmt]
    for mode in args.modes:
        spec = {**base, "system": "torchformer", "folder": folder, "scheme": scheme, "mode": mode,
                "group_size": args.group_size}  # fmt: skip
        out.append((f"torchformer {label} {mode}", spec))
    if "llama.cpp" in args.engines and not skipped.get("llama.cpp"):
        context = max(args.prompts) + args.new_tokens + 64
        for kind in kinds:
            spec = {**base, "system": "llama.cpp", "gguf": str(gguf_file(shape, kind, cache)), "context": context}
            out.append((f"llama.cpp {kind}", spec))
        mode = "compiled" if "compiled" in args.modes else args.modes[0]
        for kind in kinds if scheme is not None else ():  # issue 29: torchformer on llama.cpp's very file
            spec = {**base, "system": "torchformer", "folder": str(gguf_file(shape, kind, cache)), "scheme": None,
                    "mode": mode, "group_size": args.group_size}  # fmt: skip
            out.append((f"torchformer {kind}-file {mode}", spec))
    if "ctranslate2" in args.engines and not skipped.get("ctranslate2") and ct2_type:
        spec = {**base, "system": "ctranslate2", "ct2": str(ct2_folder(shape, ct2_type, cache)), "folder": folder,
                "compute": ct2_type}  # fmt: skip
        out.append((f"CTranslate2 {ct2_type}", spec))
    return out


def measure_format(shape: str, fmt: str, args, cache: Path, skipped: dict, logs: Path, bound: Worker) -> list[dict]:
    """Start the format's workers, warm them up, run the interleaved rounds; one row per worker.
    The streaming bound (``bound``, a worker of its own) is read before each worker's turn and
    after the last: a sample keeps the mean of the readings just before and just after it. The
    host's bandwidth moves by a third within minutes, and one reading a round (the way before
    2026-12-06 20:40) lay up to a minute from the 1B shape's first row: the same kernel over the
    same bytes read 59% of it in one row and 83% in the next."""
    specs = worker_specs(shape, fmt, args, cache, skipped)
    workers, rows = [], []
    try:
        for name, spec in specs:
            log(f"{shape} {fmt}: starting {name}")
            w = Worker(f"{shape} {name}", spec, logs)
            workers.append(w)
            hello = w.read()
            if spec["system"] == "llama.cpp":
                hello["bytes"] = gguf_streamed_bytes(Path(spec["gguf"]), llama_source(cache))
            t0 = time.perf_counter()
            w.ask("measure")  # warm-up: first-call costs and compiles stay out of the rounds
            rows.append({"system": name, "format": fmt, "engine": spec["system"], **hello,
                         "kv_per_key": kv_bytes_per_key(shape), "keys": decode_keys(args.prompts[0], args.new_tokens),
                         "warmup_s": time.perf_counter() - t0, "samples": []})  # fmt: skip
            log(f"{shape} {fmt}: {name} loaded in {hello['load_s']:.1f} s, warmed up in {rows[-1]['warmup_s']:.1f} s")
        for r in range(args.rounds):
            readings = [bound.ask("measure")["bound"]]
            samples = []
            for w in workers:  # interleaved, each between two readings of the bound
                samples.append({**w.ask("measure"), "load": os.getloadavg()[0]})
                readings.append(bound.ask("measure")["bound"])
            for i, (row, sample) in enumerate(zip(rows, samples)):
                around = readings[i : i + 2]
                row["samples"].append({**sample, "bound": sum(around) / 2, "readings": around})
            log(f"{shape} {fmt}: round {r + 1}/{args.rounds} done")
    finally:
        for w in workers:
            w.stop()
    return rows


def bf16_streamed_bytes(shape: str) -> int:
    """Bytes a batch-1 step of the shape's bf16 model reads (torch_streamed_bytes of it, from the
    shape's numbers: known before any worker loads it): every weight but the input table, unless
    the head is that table."""
    s = SHAPES[shape]
    h, kv = s["hidden"], s["kv_heads"] * (s["hidden"] // s["heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * s["d_ff"] + 2 * h  # q, o; k, v; gate, up, down; 2 norms
    return 2 * (s["layers"] * layer + h + s["vocab"] * h)  # + the final norm and the head


def kv_bytes_per_key(shape: str) -> int:
    """Bytes of one cached position of one row, every layer's key and value at 16 bits: what a decode
    step reads per key it attends over, besides the weights (torchformer's bf16 cache, llama.cpp's
    f16 one; a wider cache is counted the same: these are the bytes the step needs)."""
    s = SHAPES[shape]
    return s["layers"] * 2 * s["kv_heads"] * (s["hidden"] // s["heads"]) * 2


def decode_keys(prompt: int, new_tokens: int) -> dict[str, float]:
    """The mean number of keys a decode step attends over, per rate of ``rates``: the step that makes
    new token i (i = 1 .. n - 1; token 0 comes from the prefill) attends over prompt + i keys; the
    steady rate counts the steps after the first WARM_TOKENS."""
    return {"tok_s": prompt + new_tokens / 2, "steady_tok_s": prompt + (WARM_TOKENS + new_tokens) / 2}


def read_bytes(row: dict, batch: int, key: str = "tok_s", weights_only: bool = False) -> float:
    """Bytes one decode step of ``row`` reads at ``batch``: its weights once, and each row's KV cache
    over the keys a step attends over on average (``kv_per_key`` x ``keys``, where the row has them).
    At the toy shape (8 KV heads of 64 for a hidden 512) the cache is ~8% of the int4 weights' bytes
    at the benchmark's positions and read at the same rate as they are (2026-12-07: a step without its
    attention 41 us faster than with it, 21 us of which with the cache already in L2); at the 1B shape
    0.4%."""
    kv = 0.0 if weights_only or "kv_per_key" not in row else batch * row["kv_per_key"] * row["keys"][key]
    return row["bytes"] + kv


def bound_worker(shape: str, args, logs: Path) -> Worker:
    w = Worker(f"{shape} bound", {"system": "bound", "bytes": bf16_streamed_bytes(shape), "threads": args.threads},
               logs)  # fmt: skip
    w.read()
    return w


def cells(row: dict, batch: int) -> dict:
    """The best round of one row at one batch size."""
    per_batch = [s["batches"][str(batch)] for s in row["samples"]]
    out = {
        "prefill_ms": best(per_batch, "prefill_ms", higher=False),
        "tok_s": best(per_batch, "tok_s", higher=True),
        "tokens": per_batch[0]["tokens"] if per_batch else [],
        "rss_mb": max(s["rss_mb"] for s in row["samples"]),
        "load": min(s["load"] for s in row["samples"]),
    }
    for key in row["samples"][0]:
        if key.startswith("prefill_") and key.endswith("_ms"):
            out[key] = best(row["samples"], key, higher=False)
    return out


def engine_table(rows: list[dict], bound: float, args) -> str:
    """The markdown table of one shape, ratios torchformer / llama.cpp format for format."""
    long = [p for p in args.prompts[1:]]
    head = (
        "| format | system | batch | prefill "
        + str(args.prompts[0])
        + " (ms) | "
        + "".join(f"prefill {p} (ms, batch 1) | " for p in long)
        + "decode tok/s | decode vs llama.cpp | "
        + "".join(f"prefill {p} vs llama.cpp | " for p in long)
        + f"MB read / step (weights + KV) | GB/s | of bound | of bound after {WARM_TOKENS} tokens | "
        + "weights only: of bound | "
        + "peak RSS (MiB) | warm-up (s) | load |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for b in args.batches:
        for r in rows:
            c = cells(r, b)
            peer = next((p for p in rows if p["format"] == r["format"] and p["engine"] == "llama.cpp"
                         and (p["system"].split()[1] == file_kind(r) or not file_kind(r))), None)  # fmt: skip
            pc = cells(peer, b) if peer and r["engine"] != "llama.cpp" else None
            per_step = read_bytes(r, b)
            gbs = per_step * c["tok_s"] / b / 1e9 if c["tok_s"] else float("nan")
            weights, kv = r["bytes"] / 1e6, (per_step - r["bytes"]) / 1e6
            long_cells = "".join(f"{c.get(f'prefill_{p}_ms', 0):.0f} | " if b == 1 else "- | " for p in long)
            long_ratio = "".join(
                (ratio(pc[f"prefill_{p}_ms"], c[f"prefill_{p}_ms"]) if pc and b == 1 else "-") + " | " for p in long
            )
            lines.append(
                f"| {FORMAT_LABEL[r['format']]} | {r['system']} | {b} | {c['prefill_ms']:.0f} | {long_cells}"
                f"{c['tok_s'] or float('nan'):.1f} | {ratio(c['tok_s'], pc['tok_s']) if pc else '-'} | {long_ratio}"
                f"{weights:.{1 if weights < 100 else 0}f} + {kv:.{1 if kv < 100 else 0}f} | {gbs:.1f} | "
                f"{of_bound(r, b, bound):.0%} | {of_bound(r, b, bound, 'steady_tok_s'):.0%} | "
                f"{of_bound(r, b, bound, weights_only=True):.0%} | {c['rss_mb']:.0f} | "
                f"{r['warmup_s']:.0f} | {c['load']:.1f} |"
            )
    return "\n".join(lines)


# The issue-25 memory target: peak RSS <= the weights as held + the KV cache + 300 MB.
BUDGET_MIB = 300e6 / 2**20


def memory_notes(rows: list[dict]) -> list[str]:
    """Per torchformer row: its peak RSS beyond the weights it holds and its largest KV cache,
    against the target's 300 MB (286 MiB)."""
    parts = []
    for r in rows:
        sample = r["samples"][0] if r["samples"] else {}
        if "held_mb" in sample:
            held, kv = sample["held_mb"], sample["kv_mb"]
            beyond = max(s["rss_mb"] for s in r["samples"]) - held - kv
            inductor = any(s.get("inductor") for s in r["samples"])
            compiled = ", inductor imported: a step compiled here" if inductor else ""
            parts.append(f"{r['system']} {beyond:.0f} (weights {held:.0f}, KV cache {kv:.0f}{compiled})")
    if not parts:
        return []
    return [f"peak RSS beyond the weights held and the largest KV cache, MiB (target <= {BUDGET_MIB:.0f}): "
            + "; ".join(parts)]  # fmt: skip


def of_bound(row: dict, batch: int, bound: float, key: str = "tok_s", weights_only: bool = False) -> float:
    """The row's reads (``read_bytes``: weights and KV cache, or the weights only) over the streaming
    bound at ``batch``: the median over rounds of each round's GB/s (from ``key``: the decode rate,
    or the steady one) over the bound read around it (``measure_format``); ``bound`` for samples
    without one."""
    per_step = read_bytes(row, batch, key, weights_only)
    fractions = sorted(
        per_step * t / batch / 1e9 / s.get("bound", bound)
        for s in row["samples"]
        if (t := s["batches"][str(batch)].get(key))
    )
    return statistics.median(fractions) if fractions else float("nan")


def file_kind(row: dict) -> str:
    """The GGUF type of a row of torchformer running llama.cpp's file ("Q4_K_M"), else ""."""
    word = row["system"].split()[1]
    return word.removesuffix("-file") if row["engine"] == "torchformer" and word.endswith("-file") else ""


def file_notes(rows: list[dict], batches: list[int]) -> list[str]:
    """Issue 29's speed row: decode tok/s of torchformer on each GGUF file over its own format's."""
    notes = []
    for r in rows:
        own = next((o for o in rows if o["format"] == r["format"] and o["engine"] == "torchformer"
                    and not file_kind(o) and o["system"].endswith(r["system"].split()[-1])), None)  # fmt: skip
        if file_kind(r) and own is not None:
            per = ", ".join(
                f"batch {b}: {ratio(cells(r, b)['tok_s'], cells(own, b)['tok_s'])}{paired(r, own, b)}" for b in batches
            )
            notes.append(f"{r['system']}: decode tok/s {per} {own['system']}'s")
    return notes


def paired(row: dict, other: dict, batch: int) -> str:
    """The per-round ratios of row's decode tok/s over other's (both measured in the same round, the
    same spell of a noisy machine): " (per round: median, min-max)", or "" with fewer than 2 rounds."""
    pairs = [(s["batches"][str(batch)].get("tok_s"), o["batches"][str(batch)].get("tok_s"))
             for s, o in zip(row["samples"], other["samples"])]  # fmt: skip
    ratios = [a / b for a, b in pairs if a and b]
    if len(ratios) < 2:
        return ""
    return f" (per round: median {statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f})"


def agreement_notes(rows: list[dict]) -> list[str]:
    """Greedy tokens of batch row 0 against torchformer's of the same format: a conversion check."""
    notes = []
    for fmt in FORMATS:
        ours = next((r for r in rows if r["format"] == fmt and r["engine"] == "torchformer"), None)
        if ours is None:
            continue
        mine = cells(ours, 1)["tokens"] if ours["samples"] and "1" in ours["samples"][0]["batches"] else []
        for r in rows:
            if r["format"] == fmt and r["engine"] != "torchformer" and mine:
                n = agreement(mine, cells(r, 1)["tokens"])
                notes.append(f"{r['system']}: first {n} of {len(mine)} greedy tokens equal {ours['system']}'s")
    return notes


# --- serving -------------------------------------------------------------------------------------------
SERVER_BUILD_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
]  # fmt: skip


def llama_server(cache: Path) -> tuple[list[str] | None, str]:
    """(command prefix, note): llama.cpp's own llama-server built once from the sdist's vendored
    source, or the binding's single-sequence `llama_cpp.server` when that build fails."""
    binary = cache / "llama-server-build" / "bin" / "llama-server"
    if not binary.exists():
        src, build = llama_source(cache), cache / "llama-server-build"
        log(f"building llama-server from {src} into {build} (once, ~5 min on 2 cores)")
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        steps = [["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *SERVER_BUILD_FLAGS],
                 ["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"]]  # fmt: skip
        for cmd in steps:
            done = subprocess.run(["nice", "-n", "19", *cmd], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stdout + done.stderr)[-800:]
                if importlib.util.find_spec("llama_cpp.server") is None:
                    return None, f"llama-server did not build and llama_cpp.server is not installed: {tail}"
                return [sys.executable, "-m", "llama_cpp.server"], f"llama-server did not build ({tail}); " + (
                    "used the binding's llama_cpp.server (one sequence at a time)"
                )
    return [str(binary)], f"llama-server built from the llama-cpp-python {LLAMA_CPP_VERSION} sdist's vendored source"


def serve_folder(folder: Path, context: int, cache: Path) -> tuple[Path, str]:
    """The folder torchformer serve gets: its cache is slots x max_position_embeddings (the 1B
    config's 131072 positions x 8 slots is ~34 GB) and there is no flag for the context yet, so a
    copy whose config.json says ``context`` (weights and tokenizer linked) unless --max-model-len exists."""
    help_text = subprocess.run(
        [str(Path(sys.executable).with_name("torchformer")), "serve", "--help"], capture_output=True, text=True
    ).stdout
    if "--max-model-len" in help_text:
        return folder, f"--max-model-len {context}"
    out = cache / f"{folder.parent.name}-serve-{context}"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            if f.name != "config.json" and f.is_file():
                (out / f.name).unlink(missing_ok=True)
                (out / f.name).symlink_to(f.resolve())
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = context
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, f"a copy of the folder with max_position_embeddings {context} (serve has no --max-model-len yet)"


def serve_prompts(folder: Path, n: int = 16, length: int = 32) -> list[str]:
    """~``length``-token windows of stdlib text, the same for every server."""
    from tokenizers import Tokenizer

    from benchmarks.serve import corpus

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(corpus(200_000)[-1][:20000]).ids
    return [tok.decode(ids[i : i + length]) for i in range(0, n * (length + 5), length + 5)]


async def one_completion(client, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    import numpy as np

    t0, times = time.perf_counter(), []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra or None
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": (times[0] if times else end) - t0, "itl": list(np.diff(times)), "e2e": end - t0,
            "tokens": len(times)}  # fmt: skip


async def drive(url: str, model: str, prompts: list[str], concurrency: int, n: int, args, extra: dict) -> dict:
    from benchmarks.serve import fire

    def request(client, i: int):
        return one_completion(client, model, prompts[i % len(prompts)], args.serve_tokens, extra)

    return await fire(url, concurrency, n, request, timeout=900)


def serve_format(shape: str, fmt: str, args, cache: Path, server_cmd: list[str], notes: list[str]) -> dict:
    """Start the format's servers, warm each up, run interleaved rounds; name -> level -> summary."""
    from benchmarks.serve import free_port, summary

    scheme, kinds, _ = FORMATS[fmt]
    folder = hf_folder(shape, cache)
    context = 512
    tf_folder, how = serve_folder(folder, context, cache)
    notes.append(f"torchformer serve got {how}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tf = [str(Path(sys.executable).with_name("torchformer")), "serve", str(tf_folder), "--slots", "8",
          "--log-level", "warning", "--served-model-name", "m"]  # fmt: skip
    tf += ["--max-model-len", str(context)] if how.startswith("--max") else []
    tf += ["--quantize", scheme] if scheme else []
    plans = [(f"torchformer serve {fmt} {mode}", tf + (["--compile"] if mode == "compiled" else []), "/health", {})
             for mode in args.modes]  # fmt: skip
    gguf = gguf_file(shape, kinds[0], cache)
    if server_cmd[0].endswith("llama-server"):
        theirs = [*server_cmd, "-m", str(gguf), "--host", "127.0.0.1", "-np", "8", "-t", str(args.threads), "-tb",
                  str(args.threads), "-c", str(8 * context), "--alias", "m", "--no-webui"]  # fmt: skip
        theirs += ["--no-repack"] if NO_REPACK else []
        extra = {"ignore_eos": True, "cache_prompt": False}  # each request prefills its prompt, as ours does
    else:
        theirs = [*server_cmd, "--model", str(gguf), "--host", "127.0.0.1", "--n_threads", str(args.threads),
                  "--n_ctx", str(context), "--model_alias", "m"]  # fmt: skip
        extra = {}
    plans.append((f"llama.cpp server {kinds[0]}", theirs, "/health" if extra else "/v1/models", extra))
    servers, best_runs = {}, {}
    try:
        for name, cmd, ready, extra in plans:
            port = free_port()
            cmd = [*cmd, "--port", str(port)]
            server = group_server(cmd, port, env)
            servers[name] = (server, extra)
            server.wait_ready(ready, args.start_timeout)
            asyncio.run(drive(server.url, "m", serve_prompts(folder), 2, 2, args, extra))  # warm-up
            log(f"serve {shape}: {name} ready")
        prompts = serve_prompts(folder)
        for r in range(args.rounds):
            for c in SERVE_LEVELS:
                for name, (server, extra) in servers.items():
                    n = max(args.serve_requests, 2 * c)
                    raw = asyncio.run(drive(server.url, "m", prompts, c, n, args, extra))
                    run = summary(raw)
                    log(f"serve round {r + 1} {name} concurrency {c}: {run['tok/s']:.1f} tok/s, {run['failures']} fail")
                    if raw["failures"]:  # what failed, said with the table (a failed request adds no tokens)
                        notes.append(f"{name}, concurrency {c}, round {r + 1}: {len(raw['failures'])} of {n} "
                                     f"requests failed, the first with {raw['failures'][0][:300]}")  # fmt: skip
                    old = best_runs.setdefault(name, {}).get(c)
                    if old is None or run["tok/s"] > old["tok/s"]:
                        best_runs[name][c] = run
        for name, (server, _) in servers.items():
            best_runs[name]["rss_mb"] = peak_rss_mb(server.proc.pid)
    finally:
        for server, _ in servers.values():
            stop_server(server)
    return best_runs


def group_server(command: list[str], port: int, env: dict):
    """benchmarks.serve.Server (readiness, output kept for the failure note) whose process leads its
    own group, so stopping it ends whatever it started (compile workers, llama-server's threads)."""
    import threading

    from benchmarks.serve import Server

    class GroupServer(Server):
        def __init__(self) -> None:
            self.url, self.lines = f"http://127.0.0.1:{port}", []
            self.proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
            )
            threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

        def stop(self) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)

    return GroupServer()


def stop_server(server) -> None:
    with contextlib.suppress(Exception):
        server.stop()
    if server.proc.poll() is None:
        kill_group(server.proc)


def serve_table(runs: dict) -> str:
    fmt3 = lambda t: "/".join(f"{x:.0f}" for x in t)  # noqa: E731
    lines = [
        "| server | concurrency | out tok/s | vs llama.cpp | TTFT p50/p90 ms | inter-token p50/p90 ms | peak RSS (MB) "
        "| failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by_c in runs.items():
        fmt = name.split()[2] if name.startswith("torchformer") else None
        peer = next((v for k, v in runs.items() if k.startswith("llama.cpp") and fmt and fmt_of(k) == fmt), None)
        for c in SERVE_LEVELS:
            r = by_c[c]
            rss = by_c.get("rss_mb")
            lines.append(
                f"| {name} | {c} | {r['tok/s']:.1f} | {ratio(r['tok/s'], peer[c]['tok/s']) if peer else '-'} | "
                f"{fmt3(r['ttft'][:2])} | {fmt3(r['itl'][:2])} | {'-' if rss is None else f'{rss:.0f}'} | "
                f"{r['failures']} |"
            )
    return "\n".join(lines)


def fmt_of(server_name: str) -> str:
    kind = server_name.rsplit(" ", 1)[-1]
    return next((f for f, (_, kinds, _) in FORMATS.items() if kind in kinds), "")


# --- main ------------------------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def names(choices):
    def parse(text: str) -> list[str]:
        out = text.split(",")
        if bad := [x for x in out if x not in choices]:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(choices)}")
        return out

    return parse


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=names(SHAPES), default=list(SHAPES))
    p.add_argument("--formats", type=names(FORMATS), default=list(FORMATS))
    p.add_argument("--modes", type=names(MODES), default=list(MODES), help="torchformer eager and/or compiled")
    p.add_argument("--engines", type=names(("llama.cpp", "ctranslate2")), default=["llama.cpp", "ctranslate2"])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--prompts", type=ints, default=[64, 512], help="prompt lengths: the first at every batch "
                   "size (with decoding), the others prefill only at batch 1")  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; every cell keeps its best")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--group-size", type=int, default=64, help="our int4 group size")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--skip-engines", action="store_true", help="serving only (the engine tables keep their sections)")
    p.add_argument("--serve-shape", choices=list(SHAPES), help="shape served (default: the last of --shapes)")
    p.add_argument("--serve-tokens", type=int, default=32)
    p.add_argument("--serve-requests", type=int, default=8, help="requests per concurrency level (at least 2 x it)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--note", default="", help="said with the table (e.g. how busy the machine was)")
    p.add_argument("--no-write", dest="write", action="store_false", help="do not update RESULTS.md")
    return p.parse_args(argv)


def run_shape(shape: str, args, skipped: dict, logs: Path) -> str:
    rows: list[dict] = []
    hf_folder(shape, args.cache)
    bound_reader = bound_worker(shape, args, logs)
    try:
        for fmt in args.formats:
            rows += measure_format(shape, fmt, args, args.cache, skipped, logs, bound_reader)
    finally:
        bound_reader.stop()
    readings = [x for r in rows for s in r["samples"] for x in s["readings"]]
    n_bytes, bound = bf16_streamed_bytes(shape), max(readings)
    s = SHAPES[shape]
    title = (
        f"Shape {shape}: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads / {s['kv_heads']} KV heads, "
        f"d_ff {s['d_ff']}, vocab {s['vocab']}, {'tied' if s['tied'] else 'untied'}"
        + (", llama3 RoPE" if s["rope_scaling"] else "")
    )
    notes = [
        f"best of {args.rounds} interleaved round(s) per cell after a warm-up call (warm-up (s): load excluded, "
        "includes torch.compile); decode = tokens after the first / their time, greedy, EOS ignored; "
        f"{args.new_tokens} new tokens after a {args.prompts[0]}-token random prompt",
        f"streaming bound (benchmarks.decode.streaming_reader over {n_bytes / 1e6:.0f} MB, the bf16 model's bytes, "
        f"read just before and just after each row's turn in every round): {min(readings):.1f}-{bound:.1f} GB/s over "
        "the run; MB read / step = the weights as the system stores them + the KV cache a step attends over "
        f"({kv_bytes_per_key(shape) / 1e3:.1f} KB a key and row at 16 bits, {args.prompts[0]} + {args.new_tokens} / 2 "
        "keys on average, x the batch); GB/s = those bytes x steps/s (at batch 8 a step decodes 8 tokens) in the "
        "row's best round; of bound = the median over the rounds of the row's GB/s over the mean of the two "
        f"readings around its turn; after {WARM_TOKENS} tokens: the same from the decode rate of the tokens after "
        f"the first {WARM_TOKENS} decoded (the bound is a warm read; the first tokens after a prefill or an idle "
        "spell re-read weights the host's shared L3 lost meanwhile: WARM_TOKENS); weights only: of bound counting "
        "the weights' bytes alone",
        "ratios: torchformer / llama.cpp in the same format (8-bit vs Q8_0, 4-bit vs Q4_0; torchformer on a GGUF "
        "file vs llama.cpp on that file); prefill ratios are speeds (llama.cpp ms / ours)",
        f"load: the lowest 1-minute load average read after the row's rounds (the measured worker itself adds up "
        f"to {args.threads}); llama.cpp's OpenMP threads spin while they wait, and its speed collapses once the load "
        f"passes the {os.cpu_count()} CPUs (measured: 2-16 tok/s against ~200 at load ~7 on the toy F16 file), so a "
        "row read well above that measures the machine, not the engine",
    ]
    by_note: dict[str, list[str]] = {}
    for r in rows:
        if r.get("note"):
            by_note.setdefault(r["note"], []).append(r["system"])
    notes += [f"{', '.join(systems)}: {note}" for note, systems in by_note.items()]
    notes += file_notes(rows, args.batches) + memory_notes(rows) + agreement_notes(rows)
    return title + "\n\n" + engine_table(rows, bound, args) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def run_serve(shape: str, args, skipped: dict) -> str:
    if skipped.get("llama.cpp"):
        return ""
    server_cmd, note = llama_server(args.cache)
    notes = [note] + ([NO_REPACK_NOTE] if NO_REPACK else [])
    if server_cmd is None:
        return f"- not run: {note}\n"
    runs = {}
    for fmt in args.formats:
        runs.update(serve_format(shape, fmt, args, args.cache, server_cmd, notes))
    notes += [
        f"streamed /v1/completions of {args.serve_tokens} new tokens (temperature 0), ~32-token text prompts, "
        f"max({args.serve_requests}, 2 x concurrency) requests per level, best of {args.rounds} interleaved round(s); "
        f"{args.threads} threads per server, 8 slots each; the load generator shares the same cores",
        "llama-server requests carry ignore_eos and cache_prompt false (each request prefills its prompt, as "
        "torchformer serve does); a token = a streamed chunk with text",
    ]
    return serve_table(runs) + "\n\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes)) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(json.loads(argv[1]))
    args = parse(argv)
    skipped = engines_available(args.engines)
    if skipped.get("llama.cpp"):
        print(INSTALL_HINT)
        return 0
    args.cache.mkdir(parents=True, exist_ok=True)
    (args.cache / ".gitignore").write_text("*\n")  # models, GGUF files and builds never reach git
    logs = args.cache / "logs"
    logs.mkdir(exist_ok=True)
    load_before = os.getloadavg()
    skip_notes = "".join(f"- {k} not measured: {v}\n" for k, v in skipped.items() if v)
    # (RESULTS.md key, title, text): one section per shape and one for serving, so a toy run and a
    # 1B run each keep their own table and command; a CPU without AVX-512 (the kernels' AVX2 build,
    # fast/csrc/wide.h) keeps its own too, next to the AVX-512 machines' tables.
    from torchformer.fast.native import isa as kernels_isa  # the parent only: no worker loads torch for it

    kind = kernels_isa()
    isa = "" if kind in ("avx512", None) else f"-{kind}"
    on = f", {kind.upper()} CPU" if isa else ""
    sections = [
        (f"engines-{shape}{isa}",
         f"CPU engines, {shape} shape{on}: torchformer vs llama.cpp and CTranslate2 (issue 25)",
         run_shape(shape, args, skipped, logs) + skip_notes)
        for shape in ([] if args.skip_engines else args.shapes)
    ]  # fmt: skip
    if not args.skip_serve:
        shape = args.serve_shape or args.shapes[-1]
        title = f"Serving, {shape} shape: torchformer serve vs llama.cpp's server (issue 25)"
        sections.append((f"engines-serve-{shape}{isa}", title.replace(" shape:", f" shape{on}:"),
                         run_serve(shape, args, skipped)))
    for _, title, text in sections:
        print(f"## {title}\n\n{text}")
    if args.write:
        from benchmarks.results import load_note, write_section

        setting = (
            f"{args.threads} threads per engine, one worker process per (system, format); {load_note(load_before)}, "
            f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs; llama-cpp-python "
            f"{LLAMA_CPP_VERSION} built from its sdist with GGML_NATIVE=ON" + (f"; {args.note}" if args.note else "")
        )
        command = "python -m benchmarks.engines" + (" " + shlex.join(argv) if argv else "")
        for key, title, text in sections:
            write_section(key, title, command, setting, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
