"""Prometheus metrics for the server, named close to vLLM's (prefix `pagoda:`), and the signals
vLLM's ecosystem reads under vLLM's own names too (vllm_metric_names.py)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.entrypoints.vllm_metric_names import with_vllm_names

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Gauges read from the engine at scrape time (running / waiting / KV usage / preemptions)."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name  # anything with .stats() -> SchedulerStats

    def collect(self):
        stats = self.engine.stats()
        for name, doc, value in [
            ("pagoda:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("pagoda:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("pagoda:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage),
            ("pagoda:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens queried.",
             stats.prefix_cache_hit_rate),
            ("pagoda:kv_cache_cached_free_blocks", "Blocks kept in the prefix cache that no request uses.",
             stats.num_cached_free_blocks),
            ("pagoda:memory_pressure", "(used KV memory - reclaimable cached memory) / total KV memory.",
             stats.memory_pressure),
            ("pagoda:sessions_pinned", "Sessions (/v1/sessions) whose KV prefix is pinned in the prefix cache.",
             stats.num_sessions_pinned),
            ("pagoda:session_pinned_kv_blocks", "KV blocks held by sessions' pins (a shared prefix counted per "
             "session).", stats.session_pinned_blocks),
        ]:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        c = CounterMetricFamily("pagoda:num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
                                labels=["model_name"])
        c.add_metric([self.model_name], stats.num_preemptions_total)
        yield c
        c = CounterMetricFamily("pagoda:session_pins_released_under_pressure", "Sessions' pinned prefixes let go "
                                "because running requests needed the blocks.", labels=["model_name"])
        c.add_metric([self.model_name], stats.session_pins_released_under_pressure)
        yield c
        for name, doc, value in [
            ("pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_query_tokens),
            ("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hit_tokens),
            ("pagoda:prefix_cache_preempted_queries", "Tokens looked up in the prefix cache by requests resumed "
             "after preemption.", stats.prefix_cache_preempted_query_tokens),
            ("pagoda:prefix_cache_preempted_hits", "Tokens found in the prefix cache by requests resumed after "
             "preemption.", stats.prefix_cache_preempted_hit_tokens),
            ("pagoda:kv_offload_memory_hits", "Prompt tokens promoted back from the host-memory KV tier "
             "(--kv-offload-memory).", stats.kv_offload_memory_hit_tokens),
            ("pagoda:kv_offload_disk_hits", "Prompt tokens promoted back from the tiers below memory: the disk "
             "tier (--kv-offload-dir) and the shared store (--kv-offload-url).", stats.kv_offload_disk_hit_tokens),
            ("pagoda:kv_offload_remote_reads", "Tokens of KV blocks read from the shared store (--kv-offload-url), "
             "read ahead or at admission.", stats.kv_offload_remote_read_tokens),
            ("pagoda:kv_offload_saved", "Tokens of KV blocks copied down into the host-memory tier.",
             stats.kv_offload_saved_tokens),
            ("pagoda:spec_decode_num_drafts", "Speculative decoding: verifications (one request's drafts in one step).",
             stats.spec_num_drafts),
            ("pagoda:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
             stats.spec_draft_tokens),
            ("pagoda:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
             stats.spec_accepted_tokens),
            ("pagoda:spec_decode_draft_seconds", "Speculative decoding: time spent proposing drafts.",
             stats.spec_draft_seconds),
            ("pagoda:spec_decode_verify_seconds", "Speculative decoding: time of the steps that verified drafts.",
             stats.spec_verify_seconds),
        ]:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        for name, doc, values in [
            ("pagoda:spec_decode_num_draft_tokens_per_pos", "Speculative decoding: drafts verified at each "
             "position of a run (0: the first draft).", stats.spec_draft_tokens_per_pos),
            ("pagoda:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: drafts accepted at each "
             "position of a run.", stats.spec_accepted_tokens_per_pos),
        ]:
            c = CounterMetricFamily(name, doc, labels=["model_name", "position"])
            for position, value in enumerate(values):
                c.add_metric([self.model_name, str(position)], value)
            yield c
        g = GaugeMetricFamily("pagoda:spec_decode_mean_accepted_length", "Speculative decoding: tokens per "
                              "verification, the target's own included (0 before the first).", labels=["model_name"])
        g.add_metric([self.model_name], stats.spec_mean_accepted_length)
        yield g


class MetricFamilies:
    """The server's counters and histograms, one registry for every model it serves: each series
    carries a `model_name` label, so several models (pagoda serve --model A --model B) share one
    /metrics page. Gauges read from an engine at scrape time are each model's `_EngineCollector`,
    registered while the model is loaded (`ServerMetrics.close` takes it away on unload)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds
        labels = ["model_name"]
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens processed.", labels, registry=registry)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", labels, registry=registry)
        self.request_success = Counter("pagoda:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=registry)
        self.ttft = Histogram("pagoda:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("pagoda:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("pagoda:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("pagoda:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.content_filter_hits = Counter("pagoda:content_filter_hits", "Terms of the content filter's word lists "
                                           "found: in prompts (refused) or in output (stopped or masked).",
                                           labels + ["list", "direction"], registry=registry)

    def render(self) -> bytes:
        return with_vllm_names(generate_latest(self.registry))


class ServerMetrics:
    """One served model's view of the metrics: its engine's gauges, and its label on the shared
    families (a server of one model makes its own families)."""

    def __init__(self, engine, model_name: str, families: MetricFamilies | None = None) -> None:
        self.families = families or MetricFamilies()
        self.registry = self.families.registry
        self.model_name = model_name
        self._collector = _EngineCollector(engine, model_name)
        self.registry.register(self._collector)
        f = self.families
        self.prompt_tokens, self.generation_tokens, self.request_success = \
            f.prompt_tokens, f.generation_tokens, f.request_success
        self.ttft, self.itl, self.queue_time, self.e2e = f.ttft, f.itl, f.queue_time, f.e2e
        self.content_filter_hits = f.content_filter_hits

    def close(self) -> None:
        """The model is unloaded: its engine gauges leave /metrics (its counters stay, as
        Prometheus counters do)."""
        self.registry.unregister(self._collector)

    def content_filter_hit(self, list_name: str, direction: str) -> None:
        """A word list's term found in a prompt (direction "input") or in output ("output")."""
        self.content_filter_hits.labels(self.model_name, list_name, direction).inc()

    def render(self) -> bytes:
        return with_vllm_names(generate_latest(self.registry))

    def tracker(self, prompt_tokens: int) -> "RequestTracker":
        return RequestTracker(self, prompt_tokens)


class RequestTracker:
    """Times one engine request from the serving side and records it when it ends."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self.m = metrics
        self.start = self.last = time.monotonic()
        self.first_token_at: float | None = None
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.queue_observed = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        label = self.m.model_name
        if self.first_token_at is None:
            self.first_token_at = now
            self.m.ttft.labels(label).observe(now - self.start)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.labels(label).observe(gap)
        self.last = now
        self.generated += n
        self.m.generation_tokens.labels(label).inc(n)

    def on_output(self, output) -> None:
        """Per output: token timings, and the queue time once the engine reports scheduling."""
        self.on_tokens(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if not self.queue_observed and m is not None and m.first_scheduled_time is not None:
            self.queue_observed = True
            self.m.queue_time.labels(self.m.model_name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def on_finish(self, reason: str) -> float:
        label = self.m.model_name
        elapsed = time.monotonic() - self.start
        self.m.e2e.labels(label).observe(elapsed)
        self.m.prompt_tokens.labels(label).inc(self.prompt_tokens)
        self.m.request_success.labels(label, reason).inc()
        return elapsed
