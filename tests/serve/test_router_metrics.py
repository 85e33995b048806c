"""Issue 27 item 7: the gauges routers scrape on /metrics (running, waiting, KV-cache usage,
prefix-cache tokens), read while a request runs and after it ends."""

from __future__ import annotations

from tests.serve.conftest import NAME, client, httpx

P = "torchformer_serve"


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    assert f"# TYPE {P}_kv_cache_usage_perc gauge" in text and f"# TYPE {P}_prefix_cache_hits_total counter" in text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}


def test_gauges_while_a_request_runs_and_after(server):
    engine, url = server
    before = scrape(url)
    assert before[f"{P}_kv_cache_usage_perc"] == 0 and before[f"{P}_requests_running"] == 0
    prompt, new = list(range(10, 22)), 20  # 12 prompt tokens
    capacity = 4 * engine.context  # slots x max-model-len
    stream = client(url).completions.create(
        model=NAME, prompt=prompt, max_tokens=new, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    seen = 0
    for chunk in stream:  # every token is a chunk (return_token_ids)
        seen += len(getattr(chunk.choices[0], "token_ids", None) or [])  # none on the finish chunk
        if seen == 3:
            during = scrape(url)
    assert seen == new
    assert during[f"{P}_requests_running"] == 1 and during[f"{P}_requests_queued"] == 0
    # The row holds the prompt and at least the 3 tokens received, at most all 20.
    assert (12 + 3 - 1) / capacity <= during[f"{P}_kv_cache_usage_perc"] <= (12 + new) / capacity
    after = scrape(url)
    assert after[f"{P}_kv_cache_usage_perc"] == 0 and after[f"{P}_requests_running"] == 0
    assert after[f"{P}_prefix_cache_queries_total"] - before[f"{P}_prefix_cache_queries_total"] == 12
    assert after[f"{P}_prefix_cache_hits_total"] == 0  # no prefix reuse yet
