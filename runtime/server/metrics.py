"""Prometheus metrics (`--metrics`): the scheduler's state read at each scrape, and latency
histograms observed as answers stream."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, host):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(host))
        self.ttft = Histogram("llamba_time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.itl = Histogram("llamba_inter_token_latency_seconds", "Time between two tokens of one answer",
                             buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56), registry=self.registry)
        self.requests = Counter("llamba_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    def __init__(self, host):
        self.host = host

    def collect(self):
        sch = self.host.scheduler
        if sch is None:
            return
        st = sch.stats
        yield GaugeMetricFamily("llamba_requests_running", "Requests being computed", value=st.running)
        yield GaugeMetricFamily("llamba_requests_waiting", "Requests waiting to be admitted", value=st.waiting)
        kv = GaugeMetricFamily("llamba_kv_blocks", "KV-cache blocks by state", labels=["state"])
        for state in ("used", "cached", "free"):
            kv.add_metric([state], st.kv.get(f"blocks_{state}", 0))
        yield kv
        cache = sch.cache
        limits = [p.max_cached for p in cache.pools]
        yield GaugeMetricFamily("llamba_kv_blocks_cached_limit",
                                "Most blocks kept cached for prefix reuse (--cache-ram; the pool where unbounded)",
                                value=sum(p.num_blocks if m is None else m for p, m in zip(cache.pools, limits)))
        yield GaugeMetricFamily("llamba_kv_blocks_touched",
                                "Blocks ever handed out (on the CPU the pool's pages are mapped on first use: "
                                "its memory is these blocks)", value=sum(p.touched for p in cache.pools))
        # (where layer groups have pools of their own, llamba_kv_blocks counts each pool's blocks:
        # their mean size times a count is the memory they hold)
        yield GaugeMetricFamily("llamba_kv_block_bytes", "Bytes of one block counted in llamba_kv_blocks (mean)",
                                value=cache.bytes_per_token * cache.block_size / len(cache.pools))
        yield CounterMetricFamily("llamba_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)",
                                  value=st.prompt_tokens)
        yield CounterMetricFamily("llamba_generated_tokens", "Tokens generated", value=st.generated_tokens)
        yield CounterMetricFamily("llamba_preemptions", "Requests preempted for KV memory", value=st.preemptions)
