"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (never the global one,
so several servers or tests in one process do not collide).

Request series are recorded as requests finish (a request the client left, before its first
block too, counts as an abort); the engine gauges (running, waiting, KV use) are the counters
the engine thread keeps after each step (``AsyncLLM.stats``), read without the engine lock
when ``/metrics`` is scraped."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dllm.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "dllm:"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0, 320.0)
FORWARDS_PER_BLOCK_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128, 256)
TOKENS_PER_FORWARD_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0,
                              32.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = PREFIX
        self.running = Gauge(f"{p}num_requests_running", "Requests admitted to the engine "
                             "(holding a request slot and KV pages).", registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests queued for admission.",
                             registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "Fraction of usable KV pages in use "
                              "(0 to 1).", registry=r)
        self.kv_used = Gauge(f"{p}kv_cache_used_pages", "KV pages in use by requests (prefix-"
                             "cache pages no request uses count as free: they are evicted "
                             "when needed).", registry=r)
        self.kv_total = Gauge(f"{p}kv_cache_total_pages", "Usable KV pages.", registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens of "
                                         "finished requests.", registry=r)
        self.finished = Counter(f"{p}requests_finished", "Finished requests by finish reason "
                                "(stop, length, abort, error).", ["finished_reason"],
                                registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time from the request's "
                              "arrival to its first committed block.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Time from the request's "
                             "arrival to its end.", buckets=LATENCY_BUCKETS, registry=r)
        self.forwards_per_block = Histogram(
            f"{p}denoise_forwards_per_block", "Denoise forwards a block took before it was "
            "committed (a request's blocks are observed at its mean).",
            buckets=FORWARDS_PER_BLOCK_BUCKETS, registry=r)
        self.tokens_per_forward = Histogram(
            f"{p}tokens_per_forward", "Tokens committed per model forward, one observation "
            "per finished request.", buckets=TOKENS_PER_FORWARD_BUCKETS, registry=r)
        self.cache_queries = Counter(
            f"{p}prefix_cache_queries", "Prompt tokens of admitted requests, looked up in the "
            "prefix cache.", registry=r)
        self.cache_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens the prefix cache "
                                  "served (not prefilled).", registry=r)
        self.cache_hit_rate = Gauge(f"{p}prefix_cache_hit_rate", "prefix_cache_hits over "
                                    "prefix_cache_queries since the start (0 to 1).", registry=r)
        self.cache_pages = Gauge(f"{p}prefix_cache_pages", "KV pages the prefix cache holds "
                                 "(those no request uses are evicted when needed).",
                                 registry=r)
        self._cache_seen = (0, 0)  # the engine's totals at the last scrape
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(finished_reason=reason)

    # ---- per request ---------------------------------------------------------------------
    def on_first_chunk(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_finish(self, out: RequestOutput, seconds: float) -> None:
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.finished.labels(finished_reason=out.finish_reason or "error").inc()
        self.e2e.observe(seconds)
        if out.num_blocks > 0:
            # The engine reports a request's totals; each of its blocks counts once, at the
            # mean, so the histogram's sum and count are exact.
            mean = out.num_denoise_forwards / out.num_blocks
            for _ in range(out.num_blocks):
                self.forwards_per_block.observe(mean)
        if out.num_forward_passes > 0:
            self.tokens_per_forward.observe(out.tokens_per_forward)

    def on_abandoned(self, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        """The client left before the end: the engine aborted the request."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.finished.labels(finished_reason="abort").inc()
        self.e2e.observe(seconds)

    # ---- engine gauges -------------------------------------------------------------------
    def set_engine_stats(self, running: int, waiting: int, used_pages: int,
                         total_pages: int, cache_queries: int = 0, cache_hits: int = 0,
                         cache_pages: int = 0) -> None:
        """The engine's gauges, and its prefix-cache totals (the counters advance by what
        the engine counted since the last scrape)."""
        seen_q, seen_h = self._cache_seen
        if cache_queries > seen_q or cache_hits > seen_h:
            self.cache_queries.inc(max(cache_queries - seen_q, 0))
            self.cache_hits.inc(max(cache_hits - seen_h, 0))
            self._cache_seen = (max(cache_queries, seen_q), max(cache_hits, seen_h))
        self.cache_hit_rate.set(cache_hits / cache_queries if cache_queries else 0.0)
        self.cache_pages.set(cache_pages)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(used_pages)
        self.kv_total.set(total_pages)
        self.kv_usage.set(used_pages / total_pages if total_pages else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

