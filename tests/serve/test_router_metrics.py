"""Issue 27 item 7: the gauges routers scrape on /metrics (running, waiting, KV-cache usage,
prefix-cache tokens), read while the engine is held after a known number of decode steps, and
after the requests end."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tests.serve.conftest import NAME, client, httpx, wait_until

P = "torchformer_serve"


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    assert f"# TYPE {P}_kv_cache_usage_perc gauge" in text and f"# TYPE {P}_prefix_cache_hits_total counter" in text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}


def test_gauges_while_requests_run_and_wait(server, monkeypatch):
    engine, url = server
    before = scrape(url)
    assert before[f"{P}_kv_cache_usage_perc"] == 0 and before[f"{P}_requests_running"] == 0
    held, go, real, steps = threading.Event(), threading.Event(), engine.step, [0]

    def step():  # hold the engine after its third decode step
        real()
        steps[0] += 1
        if steps[0] == 3:
            held.set()
            go.wait(10)

    monkeypatch.setattr(engine, "step", step)
    prompt = list(range(10, 22))  # 12 tokens
    with ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(client(url).completions.create, model=NAME, prompt=prompt, max_tokens=20, temperature=0)
            assert held.wait(10)
            # Four choices need four rows; one of the server's four is busy: the request waits.
            second = pool.submit(client(url).completions.create, model=NAME, prompt=[5, 6], n=4, max_tokens=2)
            wait_until(lambda: len(engine.waiting) == 1, what="the second request to wait")
            during = scrape(url)
        finally:
            go.set()
        assert len(first.result().choices) == 1 and len(second.result().choices) == 4
    assert during[f"{P}_requests_running"] == 1 and during[f"{P}_requests_queued"] == 1
    # One row holds the prompt and 4 tokens (1 from the prefill, 3 steps) of 4 x max-model-len positions.
    assert during[f"{P}_kv_cache_usage_perc"] == (12 + 4) / (4 * engine.context)
    # A request's last tokens reach the client before the engine's next turn frees its rows: the
    # gauges fall back a moment after the answers arrive (seen in CI: one row of the second still held).
    idle = lambda m: m[f"{P}_kv_cache_usage_perc"] == 0 and m[f"{P}_requests_running"] == 0  # noqa: E731
    wait_until(lambda: idle(scrape(url)), what="the gauges to fall back to 0")
    after = scrape(url)
    assert idle(after)
    assert after[f"{P}_prefix_cache_queries_total"] - before[f"{P}_prefix_cache_queries_total"] == 12 + 2
    assert after[f"{P}_prefix_cache_hits_total"] == 0  # no prefix reuse yet
