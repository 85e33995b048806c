"""Serving throughput and latency (issue 15): `torchformer serve` against `transformers serve
--continuous-batching`, the same HF Llama folder, the same machine, one run.

The model is the decode benchmark's Llama (6 layers, d_model 512, 8 heads, SwiGLU d_ff 1368,
vocab 8192, fp32), random weights, with a byte-level BPE tokenizer of the same 8192 tokens trained
here on Python's own standard library sources, saved as an HF folder (model.safetensors,
tokenizer.json, a chat template). Each server runs as its own process on 127.0.0.1; the load generator is
`AsyncOpenAI(max_retries=0)` sending streamed chat requests (about 32 prompt tokens, exactly
--max-tokens new tokens: greedy, EOS removed) at concurrency 1, slots and 2 x slots. Reported per
server and concurrency: requests/s, output tokens/s, TTFT, inter-token and end-to-end latency
p50/p90/p99 (ms), failures. Targets: torchformer at concurrency = slots >= 3x its concurrency 1,
and >= 2x `transformers serve` output tokens/s at concurrency 8.

    python -m benchmarks.serve                       # full run; rewrites its RESULTS.md section
    python -m benchmarks.serve --requests 8 --max-tokens 16 --no-write   # smoke

``--features`` (issue 27: structured outputs, logprobs, prefix caching) is benchmarks/serve_features.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from benchmarks.decode import SHAPE, hf_model
from benchmarks.results import write_section
from benchmarks.serve_client import Server, fire, free_port, one, summary  # noqa: F401 - engines.py imports them here

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "bench-llama"


def corpus(n_bytes: int = 1_000_000) -> list[str]:
    """Text from the standard library's .py files (present on every Python install)."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="ignore")
        out.append(text)
        total += len(text)
        if total >= n_bytes:
            break
    return out


def make_folder(folder: Path, max_len: int) -> list[str]:
    """Write the HF Llama folder with tokenizer and chat template; return prompts (~32 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab"], special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() == SHAPE["vocab"], f"the corpus gave only {tok.get_vocab_size()} tokens"
    torch.manual_seed(0)
    model = hf_model(max_len)  # the decode benchmark's Llama (vocab 8192 = the tokenizer's)
    model.config.eos_token_id = None  # every request generates exactly max_tokens tokens on both servers
    model.config.bos_token_id = None
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # Prompts: 32-token windows of the corpus, decoded back to text.
    ids = tok.encode(texts[-1][:20000]).ids
    return [tok.decode(ids[i : i + 32]) for i in range(0, len(ids) - 32, 37)]


async def load(url: str, model: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> dict:
    return await fire(url, concurrency, n, lambda client, i: one(client, model, prompts[i % len(prompts)], max_tokens))


def measure(servers: dict, prompts, levels, args) -> dict:
    """Interleaved: every round runs each concurrency level on each server in turn, so load from
    other processes hits both alike; each (server, level) keeps its best round (noise only slows)."""
    best: dict = {name: {} for name in servers}
    for server, model in servers.values():
        asyncio.run(load(server.url, model, prompts, 2, 4, args.max_tokens))  # warm-up (first-call costs)
    for r in range(args.rounds):
        for c in levels:
            for name, (server, model) in servers.items():
                run = summary(
                    asyncio.run(load(server.url, model, prompts, c, max(args.requests, 2 * c), args.max_tokens))
                )
                print(
                    f"round {r + 1} {name} concurrency {c}: {run['tok/s']:.1f} tok/s, {run['failures']} failures",
                    flush=True,
                )
                old = best[name].get(c)
                failures = run["failures"] + (old["failures"] if old else 0)
                best[name][c] = {**(run if old is None or run["tok/s"] > old["tok/s"] else old), "failures": failures}
    return best


def start_servers(folder: Path, args, env) -> tuple[dict, str]:
    """torchformer serve and (unless --no-hf) transformers serve, each ready; the note says why a
    server is missing."""
    bin_dir = Path(sys.executable).parent
    port = free_port()
    ours = [str(bin_dir / "torchformer"), *f"serve {folder} --port {port} --slots {args.slots}".split()]
    ours += ["--log-level", "warning"]
    servers = {"torchformer serve": (Server(ours, port, env), NAME)}
    servers["torchformer serve"][0].wait_ready("/health", args.start_timeout)
    if args.compiled:  # the compiled step: one graph per power-of-two span, compiled during the warm-up
        port = free_port()
        command = [*ours[:2], *f"{folder} --port {port} --slots {args.slots} --compile".split(), *ours[-2:]]
        servers["torchformer serve --compile"] = (Server(command, port, env), NAME)
        servers["torchformer serve --compile"][0].wait_ready("/health", args.start_timeout)
    if args.no_hf:
        return servers, "transformers serve not run (--no-hf)"
    port = free_port()
    theirs = [str(bin_dir / "transformers"), *f"serve {folder} --continuous-batching --port {port}".split()]
    theirs += ["--host", "127.0.0.1", "--device", "cpu", "--log-level", "warning"]
    hf = Server(theirs, port, env)
    try:
        hf.wait_ready("/v1/models", args.start_timeout)
    except RuntimeError as err:
        hf.stop()
        return servers, f"transformers serve could not be measured: {str(err)[-600:]}"
    servers["transformers serve (CB)"] = (hf, str(folder))
    return servers, ""


def record(key: str, title: str, argv, args, load_before: float, what: str, text: str) -> None:
    """``text`` as RESULTS.md's ``key`` section, with the command and the setting it ran in."""
    argv = sys.argv[1:] if argv is None else argv  # run as `python -m benchmarks.serve ...`
    command = "python -m benchmarks.serve" + (" " + " ".join(argv) if argv else "")
    setting = (
        f"HF Llama folder {SHAPE['n_layers']}L d{SHAPE['d_model']} V{SHAPE['vocab']} fp32, {what}, "
        f"{args.threads} torch thread(s) per server, {args.max_tokens} new tokens, best of {args.rounds} "
        f"interleaved rounds; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"on {os.cpu_count()} CPUs"
    )
    write_section(key, title, command, setting, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level (at least 2 x it)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each cell keeps its best")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (the client needs a core)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--no-hf", action="store_true", help="skip transformers serve")
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="skip torchformer serve --compile")
    p.add_argument("--no-write", action="store_true", help="print only; do not rewrite RESULTS.md")
    p.add_argument("--features", action="store_true", help="structured outputs, logprobs, prefix caching (issue 27)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    levels = sorted({1, args.slots, 2 * args.slots})
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    if args.features:
        from benchmarks.serve_features import features

        return features(args, env, argv)
    load_before = os.getloadavg()[0]  # other processes' load: the numbers are only as quiet as the machine
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / NAME
        prompts = make_folder(folder, 512)
        servers, note = start_servers(folder, args, env)
        try:
            rows = measure(servers, prompts, levels, args)
        finally:
            for server, _ in servers.values():
                server.stop()
    text = table(rows, levels, args.slots, note)
    print(text)
    if not args.no_write:
        title = "Serving: torchformer serve vs transformers serve"
        record("serve", title, argv, args, load_before, "streamed chat", text)
    return 0


def table(rows: dict, levels, slots: int, note: str) -> str:
    fmt = lambda t: "/".join(f"{x:.0f}" for x in t)  # noqa: E731
    lines = [
        "| server | concurrency | req/s | out tok/s | TTFT p50/p90/p99 ms | inter-token p50/p90/p99 ms | "
        "end-to-end p50/p90/p99 ms | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_c in rows.items():
        for c in levels:
            r = by_c[c]
            lines.append(
                f"| {name} | {c} | {r['req/s']:.2f} | {r['tok/s']:.1f} | {fmt(r['ttft'])} | {fmt(r['itl'])} | "
                f"{fmt(r['e2e'])} | {r['failures']} |"
            )
    notes = []
    theirs = rows.get("transformers serve (CB)", {})
    for name in [n for n in rows if n.startswith("torchformer")]:
        ours = rows[name]
        ratio = ours[slots]["tok/s"] / ours[1]["tok/s"]
        notes.append(f"{name} at concurrency {slots} / concurrency 1: {ratio:.2f}x (target >= 3x)")
        if theirs and 8 in ours and 8 in theirs:
            notes.append(
                f"{name} / transformers serve at concurrency 8: "
                f"{ours[8]['tok/s'] / theirs[8]['tok/s']:.2f}x (target >= 2x)"
            )
    notes.append(
        f"torchformer decodes at most --slots={slots} requests together (one static cache); at concurrency "
        f"{2 * slots} the rest wait in its queue (see TTFT), while transformers' paged cache batches them all"
    )
    if note:
        notes.append(re.sub(r"\s+", " ", note))
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


if __name__ == "__main__":
    sys.exit(main())
