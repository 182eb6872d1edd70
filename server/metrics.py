"""Prometheus metrics, named ``txlserve_*`` (and the series a vLLM dashboard reads, again as ``vllm:*``), in a
registry of the app's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from memory_store import MemoryStore
    from server.cpu_latency import CpuLatencyQos
    from server.hot_states import HotStates
    from server.scheduler import Scheduler

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RESTORE = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600)
PHASE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LIFECYCLE = ("start", "engine", "export", "handoff", "commit")  # a request's run, in order (service.py Run._final)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


class _Live(Collector):
    """Gauges and counters read at scrape time from the scheduler and the store. ``engine``: whether this
    process reports its engine's figures (batch, steps, hot set); of API servers sharing one engine process
    (``--api-server-count``) only the first does, so that a sum over the workers counts that engine once."""

    def __init__(self, scheduler: Scheduler, store: MemoryStore, hot: HotStates,
                 cpu_latency: CpuLatencyQos | None) -> None:
        self.scheduler, self.store, self.hot, self.cpu_latency = scheduler, store, hot, cpu_latency
        self.engine = True

    def collect(self) -> Iterator[Metric]:
        s, m, hot = self.scheduler, self.store.metrics, self.hot
        if self.engine:
            yield GaugeMetricFamily("txlserve_requests_running", "Requests generating in the decode batch",
                                    value=s.batch_size)
            yield GaugeMetricFamily("txlserve_requests_waiting", "Requests queued or prefilling", value=s.waiting)
            yield CounterMetricFamily("txlserve_decode_steps", "Batched decode steps", value=s.steps)
            phases = CounterMetricFamily("txlserve_engine_loop_seconds", "The engine loop thread's wall time by "
                                         "what it did (they add up; server/scheduler.py PHASES)", labels=["phase"])
            for phase, seconds in s.loop_seconds().items():
                phases.add_metric([phase], seconds)
            yield phases
            yield CounterMetricFamily("txlserve_engine_loop_tokens", "Tokens the engine loop generated, counted as "
                                      "its steps and phases are (the requests' count comes as each ends)",
                                      value=s.generated)
            yield CounterMetricFamily("txlserve_engine_loop_prompt_tokens", "Tokens the engine loop read (prompts, "
                                      "and the windows of sessions rebuilt): a prompt a request's n choices share "
                                      "is read once, but one of a few tokens, read as each choice joins the batch, "
                                      "each reads (txlserve_prompt_tokens counts every choice's)",
                                      value=s.prompt_tokens)
            if (cpu := s.cpu_seconds()) is not None:
                yield CounterMetricFamily("txlserve_engine_loop_cpu_seconds", "The engine loop thread's CPU time "
                                          "(its wall time less this: waiting for the GIL, the device or work)",
                                          value=cpu)
            yield GaugeMetricFamily("txlserve_hot_bytes", "Bytes of hot sessions (the engine's own form)",
                                    value=hot.nbytes)
            yield GaugeMetricFamily("txlserve_hot_sessions", "Hot sessions", value=len(hot))
            for name, value, doc in (("hot_hits", hot.hits, "Session restores served hot, with no copy"),
                                     ("hot_misses", hot.misses, "Session restores read from Redis"),
                                     ("evictions", hot.evictions, "Hot sessions evicted to stay within the budget")):
                yield CounterMetricFamily(f"txlserve_{name}", doc, value=value)
        for name, value, doc in (("redis_hits", m.redis_hits, "Session loads served by Redis"),
                                 ("redis_misses", m.redis_misses, "Session loads Redis did not have"),
                                 ("store_errors", m.redis_errors, "Redis errors"),
                                 ("session_demotions", m.demotions, "Sessions moved to the cold tier")):
            yield CounterMetricFamily(f"txlserve_{name}", doc, value=value)
        if self.cpu_latency is not None and self.cpu_latency.limit_us is not None:
            yield GaugeMetricFamily("txlserve_cpu_latency_qos_held", "1 while the CPU latency QoS request "
                                    "(--cpu-latency-qos-us) is held", value=int(self.cpu_latency.held))


# vLLM's names for our series (vllm:X is txlserve_X, and vLLM's older name of the inter-token latency), so that a
# dashboard made for vLLM (its Grafana one: every series with a model_name label) reads the series this server has
_VLLM_TWINS = {"time_to_first_token_seconds": ("time_to_first_token_seconds",),
               "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
               "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
               "request_queue_time_seconds": ("request_queue_time_seconds",),
               "request_prefill_time_seconds": ("request_prefill_time_seconds",),
               "request_prompt_tokens": ("request_prompt_tokens",),
               "request_generation_tokens": ("request_generation_tokens",),
               "prompt_tokens": ("prompt_tokens",), "generation_tokens": ("generation_tokens",)}


class _VllmNames(Collector):
    """Our histograms and counters again under vLLM's names, each sample labelled with ``model_name``, and vLLM's
    gauges of the engine: requests running and waiting, and ``kv_cache_usage_perc``, the share of the decode
    batch's rows in use (each running request's ring of keys and values: this server's KV cache)."""

    def __init__(self, metrics: list[Histogram | Counter], live: _Live) -> None:
        self.metrics, self.live, self.model = metrics, live, ""

    def collect(self) -> Iterator[Metric]:
        label = {"model_name": self.model}
        for metric in self.metrics:
            for family in metric.collect():
                for twin in _VLLM_TWINS[family.name.removeprefix("txlserve_")]:
                    out = Metric(f"vllm:{twin}", family.documentation, family.type, family.unit)
                    out.samples = [sample._replace(name=f"vllm:{twin}{sample.name[len(family.name):]}",
                                                   labels={**label, **sample.labels}) for sample in family.samples]
                    yield out
        if self.live.engine:
            s = self.live.scheduler
            for name, doc, value in (
                    ("num_requests_running", "Requests generating in the decode batch", s.batch_size),
                    ("num_requests_waiting", "Requests queued or prefilling", s.waiting),
                    ("kv_cache_usage_perc", "Share of the decode batch's rows in use (1: full)",
                     s.batch_size / max(1, s.capacity))):
                gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
                gauge.add_metric([self.model], value)
                yield gauge


class Metrics:
    def __init__(self, scheduler: Scheduler, store: MemoryStore, hot: HotStates,
                 cpu_latency: CpuLatencyQos | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("txlserve_requests", "HTTP requests (WebSocket handshakes too) by route and status",
                                ["route", "status"],
                                registry=r)
        self.ttft = Histogram("txlserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY,
                              registry=r)
        self.itl = Histogram("txlserve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY, registry=r)
        self.e2e = Histogram("txlserve_e2e_request_latency_seconds", "Request latency, first byte in to last out",
                             buckets=LATENCY, registry=r)
        # histograms named as vLLM names its own (vllm:request_queue_time_seconds -> txlserve_...)
        self.queue_time = Histogram("txlserve_request_queue_time_seconds", "Submitted until the engine first "
                                    "worked on the request", buckets=LATENCY, registry=r)
        self.prefill_time = Histogram("txlserve_request_prefill_time_seconds", "Reading a request's prompt",
                                      buckets=LATENCY, registry=r)
        self.request_prompt_tokens = Histogram("txlserve_request_prompt_tokens", "Prompt tokens per request, each "
                                               "choice of a batch or n counted as one (what the session already "
                                               "held is not counted)", buckets=TOKENS, registry=r)
        self.request_generation_tokens = Histogram("txlserve_request_generation_tokens", "Tokens generated per "
                                                   "request", buckets=TOKENS, registry=r)
        self.restore_time = Histogram("txlserve_session_restore_seconds", "Making a session's state ready for a "
                                      "request, by source: hot, redis (hidden states read and keys/values "
                                      "re-projected), rebuild (its token window prefilled)", ["source"],
                                      buckets=RESTORE, registry=r)
        lifecycle = Histogram("txlserve_request_lifecycle_seconds", "Where a request's time went, by phase (each "
                              "moment in one; they add up to the request's run): start (until the engine had it: "
                              "lease, restore), engine (until the engine ended it: queue, prompt, generation), "
                              "export (an engine process's export of the state), handoff (until this server had "
                              "the end and state), commit (storing it, releasing the lease); every run, appends "
                              "and session creations too; a restore from Redis is in start in-process, in engine "
                              "with an engine process", ["phase"],
                              buckets=PHASE, registry=r)
        self.lifecycle = {phase: lifecycle.labels(phase) for phase in LIFECYCLE}
        self.prompt_tokens = Counter("txlserve_prompt_tokens", "Prompt tokens of the requests, every choice's own "
                                     "(n choices of one prompt count it n times; the engine's reads: "
                                     "txlserve_engine_loop_prompt_tokens)", registry=r)
        self.generation_tokens = Counter("txlserve_generation_tokens", "Tokens generated", registry=r)
        self.disconnects = Counter("txlserve_client_disconnects", "Clients gone before their response ended",
                                   registry=r)
        self.restores = Counter("txlserve_session_restores", "Sessions made ready for a request, by where their "
                                "state came from: hot (the engine's own form), redis (hidden states), rebuild "
                                "(prefilled from the token window: a cold session, or one another checkpoint "
                                "wrote)", ["source"], registry=r)
        self.websockets = Gauge("txlserve_websocket_connections", "Open WebSocket connections", registry=r)
        # what a dashboard asks first: which build serves which model, and the process's CPU, memory and files
        # (prometheus_client's process_*, as vLLM's /metrics has them; the API server's process)
        self.build = Info("txlserve_build", "The server's version, model name and checkpoint fingerprint",
                          registry=r)
        ProcessCollector(registry=r)
        self.live = _Live(scheduler, store, hot, cpu_latency)
        r.register(self.live)
        self.vllm = _VllmNames([self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time,
                                self.request_prompt_tokens, self.request_generation_tokens, self.prompt_tokens,
                                self.generation_tokens], self.live)
        r.register(self.vllm)

    def serving(self, version: str, model: str, fingerprint: str) -> None:
        """Name what is served: ``txlserve_build``, and the ``model_name`` of vLLM's series."""
        self.build.info({"version": version, "model": model, "fingerprint": fingerprint})
        self.vllm.model = model

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_workers(expositions: dict[int, str]) -> bytes:
    """One exposition of every worker's metrics (``--workers``), each sample labelled with its ``worker``: a scrape
    reaches whichever worker took its connection, and one worker's series alone would come and go between
    scrapes (Prometheus marks a series that a scrape lacks stale). Families appear once, as the text format
    requires, with every worker's samples."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(s._replace(labels={**s.labels, "worker": str(worker)}) for s in family.samples)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
