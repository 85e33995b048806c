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

``--features`` (issue 27) measures torchformer serve alone, on its own RESULTS.md section: chat
under a JSON schema (``response_format``) and with ``logprobs`` (top 5) against plain chat at
concurrency 1 and --slots (targets: >= 0.9x and >= 0.95x the plain output tokens/s), and prefix
caching: --slots multi-turn conversations at once sharing a 1000-token system prompt, TTFT p50
with the default server against one run with --no-prefix-cache (target >= 3x lower; the greedy
answers must be the same).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.decode import SHAPE, hf_model
from benchmarks.results import write_section

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process; its output is kept for the failure note."""

    def __init__(self, command: list[str], port: int, env: dict) -> None:
        self.url, self.lines = f"http://127.0.0.1:{port}", []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_ready(self, path: str, timeout: float) -> None:
        try:  # the HTTP client the installed openai uses (openai 3.x: httpx2; earlier: httpx)
            import httpx2 as httpx
        except ImportError:
            import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("exited: " + "".join(self.lines)[-2000:])
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {timeout} s: " + "".join(self.lines)[-2000:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def one(client, model: str, prompt: str, max_tokens: int, messages=None, **extra) -> dict:
    """One streamed greedy chat request (``messages``, else one user turn of ``prompt``);
    ``extra``: more fields of the request (response_format, logprobs, ...)."""
    t0 = time.perf_counter()
    times, usage, text = [], None, []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages or [{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else len(times)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft": times[0] - t0 if times else end - t0,
        "itl": list(np.diff(times)),
        "e2e": end - t0,
        "tokens": tokens,
        "text": "".join(text),
        "cached": getattr(details, "cached_tokens", 0) or 0,
    }


async def fire(url: str, concurrency: int, n: int, request, timeout: float = 600) -> dict:
    """``n`` requests (``await request(client, i)`` for i < n) from ``concurrency`` clients at
    once against the OpenAI server at ``url``; failures are counted, not retried."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    queue = list(range(n))
    results, failures = [], []

    async def worker():
        while queue:
            i = queue.pop()
            try:
                results.append(await request(client, i))
            except Exception as err:  # noqa: BLE001 - counted and reported
                failures.append(repr(err))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall": wall, "results": results, "failures": failures}


async def load(url: str, model: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> dict:
    return await fire(url, concurrency, n, lambda client, i: one(client, model, prompts[i % len(prompts)], max_tokens))


def summary(run: dict) -> dict:
    res = run["results"]
    pct = lambda xs, q: 1000 * float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    itl = [x for r in res for x in r["itl"]]
    out = {
        "req/s": len(res) / run["wall"],
        "tok/s": sum(r["tokens"] for r in res) / run["wall"],
        "failures": len(run["failures"]),
    }
    for key, xs in (("ttft", [r["ttft"] for r in res]), ("itl", itl), ("e2e", [r["e2e"] for r in res])):
        out[key] = tuple(pct(xs, q) for q in (50, 90, 99))
    return out


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


# A schema a random model cannot finish within --max-tokens (64 strings at least): every
# constrained request writes exactly max_tokens tokens, as the plain ones do (EOS removed). Its
# strings are unbounded, as OpenAI's strict schemas are (no maxLength): xgrammar 0.2.8 fills the
# mask of a maxLength-bounded string in ~0.6 ms a token at this vocabulary, ~10x an unbounded one.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["note", "todo"]},
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["kind", "notes"],
}
FEATURES = {
    "plain chat": {},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": LONG_SCHEMA}}
    },
    "logprobs (top 5)": {"logprobs": True, "top_logprobs": 5},
}
TARGETS = {"json_schema": 0.9, "logprobs (top 5)": 0.95}


def system_prompt(folder: Path, n_tokens: int = 1000) -> str:
    """``n_tokens`` tokens of standard-library text, as the folder's tokenizer reads them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return tok.decode(tok.encode(corpus()[0][:40000]).ids[:n_tokens])


async def conversation(client, system: str, users: list[str], max_tokens: int, index: int) -> dict:
    """One multi-turn chat: each turn resends the whole conversation so far, its answers included."""
    messages, turns = [{"role": "system", "content": system}], []
    for user in users:
        messages.append({"role": "user", "content": user})
        turn = await one(client, NAME, "", max_tokens, messages=list(messages))
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
    return {"index": index, "turns": turns}


def chat_feature(client, i: int, prompts, max_tokens: int, extra: dict):
    return one(client, NAME, prompts[i % len(prompts)], max_tokens, **extra)


def feature_rows(url: str, prompts, args) -> dict:
    """{(feature, concurrency): summary}: each cell its best round (as ``measure``), and "ratio"
    the median over rounds of its tok/s over plain chat's in the same round, run just before it
    (on a busy machine one lucky round skews a ratio of bests; the median of paired ones less)."""
    best, ratios, plain = {}, {}, 0.0
    for extra in FEATURES.values():  # warm-up: first-call costs (the grammar engine's tokenizer info, the schema)
        asyncio.run(fire(url, 2, 4, functools.partial(chat_feature, prompts=prompts, max_tokens=8, extra=extra)))
    for _ in range(args.rounds):
        for c in sorted({1, args.slots}):
            for name, extra in FEATURES.items():
                n = max(args.requests, 2 * c)
                ask = functools.partial(chat_feature, prompts=prompts, max_tokens=args.max_tokens, extra=extra)
                run = summary(asyncio.run(fire(url, c, n, ask)))
                print(f"{name} concurrency {c}: {run['tok/s']:.1f} tok/s, {run['failures']} failures", flush=True)
                if name == "plain chat":  # FEATURES' first: the reference of this round's others
                    plain = run["tok/s"]
                ratios.setdefault((name, c), []).append(run["tok/s"] / plain)
                old = best.get((name, c))
                if old is not None and run["tok/s"] <= old["tok/s"]:
                    run = {**old, "failures": old["failures"] + run["failures"]}
                best[name, c] = run
    return {key: {**run, "ratio": float(np.median(ratios[key]))} for key, run in best.items()}


def prefix_run(url: str, system: str, prompts, args) -> dict:
    """--slots conversations of 3 turns at once over the shared system prompt."""

    def talk(client, i):
        return conversation(client, system, prompts[3 * i : 3 * i + 3], args.max_tokens, i)

    run = asyncio.run(fire(url, args.slots, args.slots, talk))
    turns = [t for r in run["results"] for t in r["turns"]]
    ttft = [1000 * t["ttft"] for t in turns]
    return {
        "ttft": tuple(float(np.percentile(ttft, q)) for q in (50, 90, 99)) if ttft else (float("nan"),) * 3,
        "requests": len(turns),
        "cached": sum(t["cached"] for t in turns),
        "failures": len(run["failures"]),
        "answers": {r["index"]: [t["text"] for t in r["turns"]] for r in run["results"]},
    }


def features(args, env, argv) -> int:
    """torchformer serve alone: the feature rows and the prefix-caching run (module docstring)."""
    load_before = os.getloadavg()[0]
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / NAME
        prompts = make_folder(folder, 2048)
        system = system_prompt(folder)
        servers = {}
        try:
            for name, flags in (("default", []), ("--no-prefix-cache", ["--no-prefix-cache"])):
                port = free_port()
                command = [str(bin_dir / "torchformer"), "serve", str(folder), "--port", str(port)]
                command += ["--slots", str(args.slots), "--log-level", "warning", *flags]
                servers[name] = Server(command, port, env)
                servers[name].wait_ready("/health", args.start_timeout)
            rows = feature_rows(servers["default"].url, prompts, args)
            for server in servers.values():  # warm-up: a server that has seen the system prompt before
                asyncio.run(fire(server.url, 1, 1, lambda c, i: conversation(c, system, prompts[-1:], 4, i)))
            cached = {name: prefix_run(server.url, system, prompts, args) for name, server in servers.items()}
        finally:
            for server in servers.values():
                server.stop()
    text = feature_table(rows, cached, args.slots)
    print(text)
    if not args.no_write:
        title = "Serving the OpenAI API's extras: structured outputs, logprobs, prefix caching"
        what = f"--slots {args.slots}, streamed greedy chat, a shared and busy machine"
        record("serve-api", title, argv, args, load_before, what, text)
    return 0


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


def feature_table(rows: dict, cached: dict, slots: int) -> str:
    fmt = lambda t: "/".join(f"{x:.0f}" for x in t)  # noqa: E731
    lines = [
        "| request | concurrency | out tok/s (best round) | / plain chat (median of rounds) | target | "
        "TTFT p50/p90/p99 ms | failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in sorted({1, slots}):
        for name in FEATURES:
            r = rows[name, c]
            target = f">= {TARGETS[name]}x" if name in TARGETS else ""
            ratio = f"{r['ratio']:.2f}x"
            lines.append(
                f"| {name} | {c} | {r['tok/s']:.1f} | {ratio} | {target} | {fmt(r['ttft'])} | {r['failures']} |"
            )
    lines += [
        "",
        "| prefix caching | conversations at once | requests | TTFT p50/p90/p99 ms | cached prompt tokens | failures |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in cached.items():
        lines.append(f"| {name} | {slots} | {r['requests']} | {fmt(r['ttft'])} | {r['cached']} | {r['failures']} |")
    off, on = cached["--no-prefix-cache"], cached["default"]
    same = off["answers"] == on["answers"] and len(on["answers"]) == slots
    notes = [
        f"prefix caching: TTFT p50 {off['ttft'][0] / on['ttft'][0]:.1f}x lower than with --no-prefix-cache "
        f"(target >= 3x); the same greedy answers: {'yes' if same else 'NO'}",
        "json_schema: a schema of at least 64 strings, so a constrained answer is as long as a plain one "
        "(--max-tokens); the grammar's mask is computed and applied on the engine thread for each token",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


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
