"""Fixtures for the GGUF tests: tiny random Hugging Face models (built from config objects, never
downloaded) converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python
sdist, found or fetched by benchmarks/engines.py) and quantized by llama_model_quantize; and
llama.cpp's own logits, greedy tokens and tokenization through llama-cpp-python.

Files are made once per process into a temporary folder (a model is ~1 MB), by one converter
process per test process (Converter).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.engines import CACHE, CONVERT, byte_level_bpe, llama_source
from torchformer.interop.gguf.llamacpp import plain_buffers

ROOT = Path(tempfile.mkdtemp(prefix="tfm-gguf-"))
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)

# The fixed multilingual set the tokenizer is trained on and checked against llama.cpp with.
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Über allen Gipfeln ist Ruh, in allen Wipfeln spürest du kaum einen Hauch.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我能吞下玻璃而不伤身体。日本語のテキストも少し。",
    "مرحبا بالعالم — emoji 🙂🚀 and numbers 12345 67.89",
    "def f(x):\n    return x ** 2  # code\t\ttabs  and   spaces",
    "  leading spaces, 'quotes' and \"double\" ones; don't won't I'm",
]
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def bpe_tokenizer(folder: Path, vocab: int) -> None:
    """tokenizer.json: a byte-level BPE trained on TEXTS, padded with merges to exactly ``vocab``."""
    raw = byte_level_bpe(TEXTS * 4, vocab, vocab, SPECIALS)
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# family -> (transformers config class, its arguments); 256 wide so K-quants (256-wide blocks) apply.
SHAPE = dict(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
# Every family whose greedy tokens a test compares is initialised wider than transformers' 0.02
# (at 0.02 a 2-layer stack is near the identity and its greedy continuation is the
# token-to-next-token map of the head: measured 5 distinct tokens in 32 for llama, 3 llama-tied,
# 9 qwen2 and phi3, 1 gemma, 12 gemma2), its head then scaled down (HEAD_SCALE) to keep logits
# near 2 as the tolerances assume. Each init is one where the greedy tokens from IDS[:4] are
# varied (>= 16 distinct in 32) and their top-2 margins (>= 3e-3 at every step, measured on the
# HF model) stay above the F16 files' logit error, so the greedy test compares implementations,
# not rounding.
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_theta=50000.0,
            rope_scaling=LLAMA3_ROPE,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            initializer_range=0.07,
        ),
    ),  # fmt: skip
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.08)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.1)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32, rms_norm_eps=1e-6, initializer_range=0.12)),
    "llama-spm": ("LlamaConfig", dict(vocab_size=448, tie_word_embeddings=False)),  # a SentencePiece tokenizer
    "gemma": ("GemmaConfig", dict(vocab_size=448, head_dim=64, initializer_range=0.05)),
    # query_pre_attn_scalar = head_dim, as llama.cpp assumes (transformers' default 256 is a model
    # llama.cpp runs differently, which to_gguf refuses to write)
    "gemma2": (
        "Gemma2Config",
        dict(vocab_size=448, head_dim=64, sliding_window=4, query_pre_attn_scalar=64, initializer_range=0.05),
    ),
}
FAMILIES["phi3"] = (
    "Phi3Config",
    dict(vocab_size=448, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.12),
)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + i / 32 for i in range(32)],
            "long_factor": [1.0 + i / 4 for i in range(32)], "original_max_position_embeddings": 64}  # fmt: skip
FAMILIES["phi3-long"] = ("Phi3Config", dict(FAMILIES["phi3"][1], rope_scaling=LONGROPE, initializer_range=0.08))
# Gemma 3: six layers so the default pattern (five sliding, then one full) has its full layer;
# linear scaling on the full layers' RoPE only (as the 4B+ models have); query_pre_attn_scalar =
# head_dim, which llama.cpp assumes for every size but the 27B (the converter does not write it).
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # fmt: skip
FAMILIES["gemma3"] = ("Gemma3TextConfig", dict(vocab_size=448, head_dim=64, num_hidden_layers=6, sliding_window=4,
                                               query_pre_attn_scalar=64, rope_parameters=GEMMA3_ROPE))  # fmt: skip
# GPT-NeoX: no GQA; the converter reads the 4.x name rotary_pct, which transformers 5 no longer
# saves: config.json gets it added.
# These two (and the MoE ones below) are initialised wider (0.02 gives a greedy continuation of 3
# and 11 distinct tokens: the token-to-next-token map of a near-identity stack); their heads are
# then scaled down (HEAD_SCALE) to keep logits near 2, which keeps the argmax and the tolerances' scale.
FAMILIES["gptneox"] = ("GPTNeoXConfig", dict(num_key_value_heads=4, initializer_range=0.3))
HEAD_SCALE = {"gptneox": 0.1, "qwen2moe": 0.2, "qwen3moe": 0.2}
HEAD_SCALE.update(dict.fromkeys(["llama", "llama-tied", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "phi3-long"], 0.3))
CONFIG_JSON = {"gptneox": {"rotary_pct": 0.25}}
# The converter reads hparams through transformers' AutoConfig.to_dict(), which drops names
# transformers 5 renamed: for the families here (CONFIG_JSON) it also takes config.json's keys the
# dict lacks ("raw_keys", CONVERT_SERVER below).
FAMILIES["olmo2"] = ("Olmo2Config", dict(tie_word_embeddings=False, initializer_range=0.05))
# Qwen MoE: four experts, two per token, every layer routed (llama.cpp's graphs have no dense
# layers); Qwen3-MoE renormalises the top-k weights (llama.cpp's qwen3moe graph always does).
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
           tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
FAMILIES["qwen2moe"] = ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=256))
FAMILIES["qwen3moe"] = ("Qwen3MoeConfig", dict(MOE, norm_topk_prob=True))
# DeepSeek-V3 (llama.cpp's deepseek2): latent attention with a q rank, a dense first layer, then
# four routed experts (two per token) and one shared; the sigmoid router's selection bias random
# (transformers starts it at zero). transformers' config has no scoring_func, which the converter
# reads for the gating function (llama.cpp's default is V2's softmax): config.json gets it.
MLA = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
DEEPSEEK_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5)  # fmt: skip
FAMILIES["deepseek2"] = ("DeepseekV3Config", dict(MLA, **DEEPSEEK_MOE, num_key_value_heads=4, tie_word_embeddings=False,
                                                  initializer_range=0.1))  # fmt: skip
HEAD_SCALE["deepseek2"] = 0.3
CONFIG_JSON["deepseek2"] = {"scoring_func": "sigmoid"}
# llama.cpp converts Gemma's tokenizer.model only
SENTENCEPIECE = ("llama-spm", "gemma", "gemma2", "gemma3", "phi3", "phi3-long")


# The converter's main script (CONVERT's path and patch, benchmarks/engines.py) run again and again in one
# process: a conversion in a process of its own paid ~5 s of CPU importing torch, transformers and
# the converter's modules, 14 families a run (issue 33). Requests are JSON lines on stdin
# ({"args": [...], "raw_keys": bool}), each answered with one JSON line ({"code": int}) on the file
# descriptor the parent reads; the converter's own output goes to the log (stderr). ``raw_keys``:
# config.json's keys (CONFIG_JSON) for this conversion only.
CONVERT_SERVER = (
    CONVERT[: CONVERT.index("sys.argv[0] =")]
    + """
import json, os, traceback
plain = base.ModelBase.load_hparams
def with_raw_keys(d, *a, **k):
    return {**json.load(open(d / 'config.json')), **plain(d, *a, **k)}
replies = os.fdopen(os.dup(1), 'w')
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    base.ModelBase.load_hparams = staticmethod(with_raw_keys if request['raw_keys'] else plain)
    sys.argv = [root + '/convert_hf_to_gguf.py', *request['args']]
    try:
        runpy.run_path(sys.argv[0], run_name='__main__')
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(); sys.stderr.flush()
    replies.write(json.dumps({'code': code}) + chr(10)); replies.flush()
os._exit(0)  # end of input: nothing to tidy, and no interpreter teardown (~1 s with torch loaded)
"""
)


class Converter:
    """One converter process per test process, started on the first conversion (CONVERT_SERVER)."""

    def __init__(self) -> None:
        self.log = ROOT / "converter.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", CONVERT_SERVER, str(llama_source(CACHE))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, "NO_LOCAL_GGUF": "1"})  # fmt: skip
        atexit.register(self.close)

    def convert(self, src: Path, out: Path, raw_keys: bool) -> None:
        start = self.log.stat().st_size
        request = {"args": [str(src), "--outtype", "f32", "--outfile", str(out)], "raw_keys": raw_keys}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        said = self.log.read_bytes()[start:].decode(errors="replace")[-3000:]
        assert reply, f"the converter died converting {src}:\n{said}"
        assert json.loads(reply)["code"] == 0, f"converting {src} failed:\n{said}"

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@functools.cache
def converter() -> Converter:
    return Converter()


def spm_tokenizer(folder: Path, vocab: int) -> None:
    """tokenizer.model: SentencePiece BPE trained on TEXTS with byte fallback; characters below
    98% coverage are left to the byte pieces, so the fallback is exercised."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_writer=buf, vocab_size=vocab, model_type="bpe", byte_fallback=True,
        character_coverage=0.98, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@functools.cache
def hf_folder(family: str) -> Path:
    import transformers

    from torchformer.models.saving import read_json

    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random norms (HF starts them at one) so a wrong norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
        model.get_output_embeddings().weight.mul_(HEAD_SCALE.get(family, 1.0))
    folder = ROOT / family / "hf"
    model.save_pretrained(folder)
    if family in CONFIG_JSON:
        (folder / "config.json").write_text(json.dumps({**read_json(folder / "config.json"), **CONFIG_JSON[family]}))
    if family in SENTENCEPIECE:
        spm_tokenizer(folder, cfg.vocab_size)
    else:
        bpe_tokenizer(folder, SHAPE["vocab_size"] - 8)  # room for tokens a family's tokenizer class adds
    return folder


@functools.cache
def gguf_file(family: str, kind: str = "F32") -> Path:
    """F32 by llama.cpp's converter; the other kinds quantized from it by llama_model_quantize."""
    out = ROOT / family / f"model-{kind}.gguf"
    if kind == "F32":
        converter().convert(hf_folder(family), out, raw_keys=family in CONFIG_JSON)
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(gguf_file(family)).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def need_llama_cpp() -> None:
    """Skip without llama-cpp-python, except in CI, where `make test` installs it: there, fail."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        message = "llama-cpp-python is missing: `make test` builds it (the engines extra, ~5 min on 2 cores)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def llama(path: Path):
    """llama.cpp on ``path`` in f32 throughout: f32 KV cache, flash attention off, every position's
    logits; without its extra buffer types (interop/gguf/llamacpp.py: ggml's AMX product segfaults
    on quantized files where the CPU has AMX)."""
    import llama_cpp

    with plain_buffers():
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=128,
            logits_all=True,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
            flash_attn=False,
            n_threads=1,
            n_threads_batch=1,
            verbose=False,
        )


def llama_logits(path: Path, ids: list[int]) -> torch.Tensor:
    llm = llama(path)
    llm.eval(ids)
    return torch.tensor(llm.scores[: len(ids)])  # (T, V)


def llama_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    llm, out = llama(path), []
    llm.eval(ids)
    for _ in range(n):
        nxt = int(llm.scores[llm.n_tokens - 1].argmax())
        out.append(nxt)
        llm.eval([nxt])
    return out


def llama_tokenize(path: Path, text: str, add_bos: bool) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode(), add_bos=add_bos, special=False)


def llama_detokenize(path: Path, ids: list[int]) -> str:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False).detokenize(ids).decode()


def llama_metadata(path: Path) -> dict:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False).metadata
