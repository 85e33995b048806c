"""Prometheus text exposition (format 0.0.4) for the engine, without a client library: a few
counters, gauges read from the engine, and cumulative histograms.

What inference gateways and routers scrape, next to vLLM's names (docs/tutorials/serve.md):
``requests_running`` (vllm:num_requests_running), ``requests_queued`` (vllm:num_requests_waiting),
``kv_cache_usage_perc`` (vllm:kv_cache_usage_perc, formerly gpu_cache_usage_perc: a fraction in
[0, 1] of the cache's positions that running requests hold), ``prefix_cache_hits_total`` and
``prefix_cache_queries_total`` (vllm:prefix_cache_hits / prefix_cache_queries: prompt tokens found
in a row's cache and not prefilled (prefix.py) / prompt tokens of the prefilled requests).
``engine_cpu_seconds_total`` (the engine thread's CPU time: forwards, sampling, grammar masks,
logprobs) and ``process_cpu_seconds_total`` (the whole server's: the Prometheus clients' name
for it, with our prefix) tell how busy the engine is apart from the neighbours' load
(benchmarks/serve_features.py reads them per generated token)."""

from __future__ import annotations

import bisect
import threading
import time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return [*out, f"{name}_sum {self.total}", f"{name}_count {self.n}"]


class Metrics:
    """Updated by the engine thread, read by the app; one lock keeps a scrape consistent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}  # by finish reason (stop, length, cancelled, error)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prefix_queries, self.prefix_hits = 0, 0  # prompt tokens looked up / found in a row's cache
        self.ttft = Histogram()
        self.inter_token = Histogram()
        self.engine_cpu = 0.0  # seconds; set by the engine thread at each turn of its loop (one float store)

    def finish(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def tokens(self, prompt: int = 0, completion: int = 0) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def prefix(self, queried: int, hit: int) -> None:
        with self.lock:
            self.prefix_queries += queried
            self.prefix_hits += hit

    def observe(self, histogram: Histogram, value: float) -> None:
        with self.lock:
            histogram.observe(value)

    def render(self, running: int, queued: int, kv_usage: float = 0.0) -> str:
        p = "torchformer_serve"
        with self.lock:
            lines = [
                f"# TYPE {p}_requests_running gauge",
                f"{p}_requests_running {running}",
                f"# TYPE {p}_requests_queued gauge",
                f"{p}_requests_queued {queued}",
                f"# TYPE {p}_kv_cache_usage_perc gauge",
                f"{p}_kv_cache_usage_perc {kv_usage!r}",
                f"# TYPE {p}_prefix_cache_queries_total counter",
                f"{p}_prefix_cache_queries_total {self.prefix_queries}",
                f"# TYPE {p}_prefix_cache_hits_total counter",
                f"{p}_prefix_cache_hits_total {self.prefix_hits}",
                f"# TYPE {p}_requests_finished_total counter",
                *(f'{p}_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())),
                f"# TYPE {p}_prompt_tokens_total counter",
                f"{p}_prompt_tokens_total {self.prompt_tokens}",
                f"# TYPE {p}_generation_tokens_total counter",
                f"{p}_generation_tokens_total {self.completion_tokens}",
                f"# TYPE {p}_engine_cpu_seconds_total counter",
                f"{p}_engine_cpu_seconds_total {self.engine_cpu!r}",
                f"# TYPE {p}_process_cpu_seconds_total counter",
                f"{p}_process_cpu_seconds_total {time.process_time()!r}",
                f"# TYPE {p}_time_to_first_token_seconds histogram",
                *self.ttft.lines(f"{p}_time_to_first_token_seconds"),
                f"# TYPE {p}_inter_token_seconds histogram",
                *self.inter_token.lines(f"{p}_inter_token_seconds"),
            ]
        return "\n".join(lines) + "\n"
