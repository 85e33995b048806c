"""The serving benchmarks' load harness: a server process (``Server``), a free port, one streamed
chat request timed per token (``one``), many at a fixed concurrency (``fire``) and their
summary (``summary``). benchmarks/serve.py, serve_features.py and engines.py drive it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time

import numpy as np


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
