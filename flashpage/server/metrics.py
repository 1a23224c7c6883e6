"""Prometheus metrics of the server, in a registry of their own (never the global one).

Two kinds of figures:
- engine state (requests running/waiting, KV cache usage and blocks in use, prefix-cache
  hit rate and the host tier's share with KV offloading, preemptions), read at scrape time from a ``LLMEngine.stats()`` snapshot the
  engine thread takes between two steps (``set_engine_stats``);
- per-request events (prompt and generated tokens, time to first token, inter-token
  latency, end-to-end latency, finishes by reason), recorded on the engine thread as
  outputs come out (``on_added`` / ``on_output`` / ``on_aborted``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flashpage.outputs import RequestOutput

P = "flashpage:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)


@dataclass
class _Track:
    """What the metrics remember about one live request (engine thread only)."""

    n: int
    tokens: list[int] = field(default_factory=list)  # per choice, generated so far
    finished: list[bool] = field(default_factory=list)
    last_token_time: float | None = None
    saw_prompt: bool = False


class _EngineStateCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        kv = s["kv_cache"]
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s["num_running"]),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", kv.usage),
            ("kv_cache_blocks_used", "KV cache blocks held by requests.", kv.blocks_used),
            ("kv_cache_blocks_total", "KV cache blocks in the pool.", kv.num_blocks),
            ("prefix_cache_hit_rate", "Prefix-cache hits / queries since start (0-1).",
             kv.prefix_hit_rate),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(P + name, doc, value=float(value))
        counters = [
            ("num_preemptions", "Requests preempted (blocks freed, recomputed later).",
             s["num_preemptions"]),
            ("prefix_cache_queries", "Prefix-cache block lookups.", kv.prefix_queries),
            ("prefix_cache_hits", "Prefix-cache block lookups that hit.", kv.prefix_hits),
        ]
        if kv.host_blocks:  # KV offloading (engine/kv_offload.py): the host tier's share
            counters += [
                ("prefix_cache_host_hits", "Of prefix_cache_hits, tokens loaded back from the "
                 "host (CPU) tier instead of recomputed.", kv.host_hits),
                ("kv_offload_stored_blocks", "KV blocks copied to the host tier.", kv.host_stores),
                ("kv_offload_loaded_blocks", "KV blocks copied back from the host tier.", kv.host_loads),
            ]
            yield GaugeMetricFamily(P + "kv_offload_blocks_cached",
                                    "Host-tier blocks holding a prefix block.",
                                    value=float(kv.host_blocks_cached))
            yield GaugeMetricFamily(P + "kv_offload_blocks_total", "Host-tier blocks in all.",
                                    value=float(kv.host_blocks))
        enc = s.get("encoder_cache")
        if enc is not None:  # an image model's encoder outputs kept for later requests
            counters += [
                ("encoder_cache_queries", "Images (and videos) looked up in the encoder cache.", enc["queries"]),
                ("encoder_cache_hits", "Of encoder_cache_queries, those whose rows were kept (not encoded).",
                 enc["hits"]),
            ]
            yield GaugeMetricFamily(P + "encoder_cache_rows", "Rows (encoder outputs) the encoder cache keeps.",
                                    value=float(enc["rows"]))
        spec = s.get("spec_decode")
        if spec is not None:  # vLLM's spec_decode_* counters
            counters += [
                ("spec_decode_num_drafts", "Steps in which a request ran drafts.", spec["num_drafts"]),
                ("spec_decode_num_draft_tokens", "Draft tokens run.", spec["num_draft_tokens"]),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec["num_accepted_tokens"]),
            ]
        for name, doc, value in counters:
            yield CounterMetricFamily(P + name, doc, value=float(value))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds",
                              "Arrival (HTTP request received) to first generated token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Time between two consecutive steps that gave a request tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds",
                             "Arrival to last token of finished requests.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter(P + "request_finished",
                                "Finished sequences (choices) by finish reason.",
                                ["finish_reason"], registry=r)
        self.http_errors = Counter(P + "http_errors", "Error responses by status code.",
                                   ["status"], registry=r)
        self._state = _EngineStateCollector()
        r.register(self._state)
        self._live: dict[str, _Track] = {}

    # ------------------------------------------------------------------ engine thread
    def on_added(self, request_id: str, n: int) -> None:
        self._live[request_id] = _Track(n, [0] * n, [False] * n)

    def on_output(self, out: RequestOutput, now: float) -> None:
        t = self._live.get(out.request_id)
        if t is None:
            return
        if not t.saw_prompt:
            t.saw_prompt = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        new = 0
        for o in out.outputs:
            if o.index >= t.n:
                continue
            k = len(o.token_ids)
            new += max(k - t.tokens[o.index], 0)
            t.tokens[o.index] = k
            if o.finish_reason is not None and not t.finished[o.index]:
                t.finished[o.index] = True
                self.finished.labels(finish_reason=o.finish_reason).inc()
        if new:
            self.generation_tokens.inc(new)
            if t.last_token_time is None:
                m = out.metrics
                if m is not None and m.ttft is not None:
                    self.ttft.observe(max(m.ttft, 0.0))
            else:
                self.itl.observe(now - t.last_token_time)
            t.last_token_time = now
        if out.finished:
            del self._live[out.request_id]
            m = out.metrics
            if m is not None:
                self.e2e.observe(max(now - m.arrival_time, 0.0))

    def on_aborted(self, request_id: str) -> None:
        t = self._live.pop(request_id, None)
        if t is None:
            return
        left = sum(1 for f in t.finished if not f)
        if left:
            self.finished.labels(finish_reason="abort").inc(left)

    # ------------------------------------------------------------------ scrape side
    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        self._state.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
