"""`python -m benchmarks.serve --features` (issue 27): torchformer serve alone, on its own
RESULTS.md section (serve-api). Chat under a JSON schema (``response_format``) and with
``logprobs`` (top 5) against plain chat at concurrency 1 and --slots (targets: >= 0.9x and >=
0.95x the plain output tokens/s), and prefix caching: --slots multi-turn conversations at once
sharing a 1000-token system prompt, TTFT p50 with the default server against one run with
--no-prefix-cache (target >= 3x lower; the greedy answers must be the same).

Wall-clock tokens/s on a shared machine move with the neighbours' load, so each run also reads
the server's own CPU time from its ``/metrics`` before and after: the engine thread's
(``engine_cpu_seconds_total``: the forward, sampling, grammar masks, logprobs) and the whole
process's (``process_cpu_seconds_total``: the HTTP side too) per generated token. A feature's
CPU ratio is plain chat's CPU per token over its own in the same round (1.0x: it costs nothing
more), the median over rounds, as the tokens/s ratio is.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.serve import NAME, corpus, make_folder, record
from benchmarks.serve_client import Server, fire, free_port, one, summary

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
COUNTERS = ("engine_cpu_seconds_total", "process_cpu_seconds_total", "generation_tokens_total")


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


def counters(url: str) -> dict[str, float]:
    """The server's CPU and token counters (COUNTERS) from its Prometheus text."""
    try:  # the HTTP client the installed openai uses (openai 3.x: httpx2; earlier: httpx)
        import httpx2 as httpx
    except ImportError:
        import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("torchformer_serve_")
        if key in COUNTERS:
            values[key] = float(value)
    return values


def cpu_per_token(before: dict, after: dict) -> tuple[float, float]:
    """(engine-thread, process) CPU ms per generated token between two counter readings."""
    tokens = after["generation_tokens_total"] - before["generation_tokens_total"]
    per = lambda key: 1000 * (after[key] - before[key]) / max(tokens, 1)  # noqa: E731
    return per("engine_cpu_seconds_total"), per("process_cpu_seconds_total")


def feature_rows(url: str, prompts, args) -> dict:
    """{(feature, concurrency): summary}: each cell its best round (as serve.measure), "ratio" the
    median over rounds of its tok/s over plain chat's in the same round, run just before it (on a
    busy machine one lucky round skews a ratio of bests; the median of paired ones less), and
    "cpu" / "cpu ratio" the same for the server's CPU per token (module docstring)."""
    best, ratios, cpus, plain = {}, {}, {}, (0.0, 0.0, 0.0)
    for extra in FEATURES.values():  # warm-up: first-call costs (the grammar engine's tokenizer info, the schema)
        asyncio.run(fire(url, 2, 4, functools.partial(chat_feature, prompts=prompts, max_tokens=8, extra=extra)))
    for _ in range(args.rounds):
        for c in sorted({1, args.slots}):
            for name, extra in FEATURES.items():
                n = max(args.requests, 2 * c)
                ask = functools.partial(chat_feature, prompts=prompts, max_tokens=args.max_tokens, extra=extra)
                before = counters(url)
                run = summary(asyncio.run(fire(url, c, n, ask)))
                engine, process = cpu_per_token(before, counters(url))
                print(
                    f"{name} concurrency {c}: {run['tok/s']:.1f} tok/s, engine {engine:.2f} / process "
                    f"{process:.2f} CPU ms a token, {run['failures']} failures",
                    flush=True,
                )
                if name == "plain chat":  # FEATURES' first: the reference of this round's others
                    plain = (run["tok/s"], engine, process)
                ratios.setdefault((name, c), []).append(run["tok/s"] / plain[0])
                cpus.setdefault((name, c), []).append((engine, process, plain[1] / engine, plain[2] / process))
                old = best.get((name, c))
                if old is not None and run["tok/s"] <= old["tok/s"]:
                    run = {**old, "failures": old["failures"] + run["failures"]}
                best[name, c] = run
    out = {}
    for key, run in best.items():
        engine, process, engine_ratio, process_ratio = np.median(np.array(cpus[key]), axis=0).tolist()
        cpu = {"engine": engine, "process": process, "engine ratio": engine_ratio, "process ratio": process_ratio}
        out[key] = {**run, "ratio": float(np.median(ratios[key])), "cpu": cpu}
    return out


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


def feature_table(rows: dict, cached: dict, slots: int) -> str:
    fmt = lambda t: "/".join(f"{x:.0f}" for x in t)  # noqa: E731
    lines = [
        "| request | concurrency | out tok/s (best round) | / plain chat (median of rounds) | target | "
        "engine CPU ms / token | / plain chat (CPU) | process CPU ms / token | / plain chat (CPU) | "
        "TTFT p50/p90/p99 ms | failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted({1, slots}):
        for name in FEATURES:
            r, cpu = rows[name, c], rows[name, c]["cpu"]
            target = f">= {TARGETS[name]}x" if name in TARGETS else ""
            lines.append(
                f"| {name} | {c} | {r['tok/s']:.1f} | {r['ratio']:.2f}x | {target} | {cpu['engine']:.2f} | "
                f"{cpu['engine ratio']:.2f}x | {cpu['process']:.2f} | {cpu['process ratio']:.2f}x | "
                f"{fmt(r['ttft'])} | {r['failures']} |"
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
        "CPU ms / token: the server's own CPU time per generated token from its /metrics before and after "
        "each run (engine_cpu_seconds_total: the engine thread; process_cpu_seconds_total: the whole "
        "server, HTTP included), the median over rounds; '/ plain chat (CPU)' is plain chat's CPU per "
        "token over the feature's in the same round (1.00x: no extra cost). The neighbours' load moves "
        "CPU time far less than wall-clock time",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
