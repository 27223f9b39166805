"""vLLM's metric names (``vllm:*``) with Ferry's meanings, so that dashboards, alerts,
autoscalers and scrape configs written for vLLM work against Ferry.

Names, types, label names (``model_name``, ``engine``, ``finished_reason``) and bucket
bounds are vLLM's (``vllm/v1/metrics/loggers.py``); the counter names gain ``_total`` in
the exposition, as vLLM's do. One ``EngineTally`` per worker (vLLM's unit is an engine;
Ferry's engine is a worker, so ``engine`` carries the worker id) counts what vLLM counts;
``families`` renders tallies as Prometheus families. Both the worker's own ``/metrics``
and the gateway's fleet view render through it, the latter from the tallies workers put
in their heartbeats (``EngineTally.encode``): a series reads the same wherever it is
scraped, so ``max by (model_name, engine)`` removes the copies when both are.

Torch-free and importable by every layer (the gateway renders, workers count).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

LABELS = ("model_name", "engine")
QUEUE_ENGINE = "(queue)"
"""The ``engine`` of the gateway's queue series (requests no worker has taken yet); no
worker id can take this value (ids are ``[A-Za-z0-9_.:-]``)."""

FINISHED_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``finished_reason`` values with a Ferry meaning (vLLM's ``repetition`` has none)."""
_REASON_OF = {"stop": "stop", "length": "length", "error": "error",
              "abort": "abort", "cancelled": "abort", "timeout": "abort"}

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
"""1, 2, 5, 10, ... 10**6: vLLM's 1-2-5 series, which vLLM cuts at ``max_model_len``
(bounds past a worker's longest context just read as ``+Inf``)."""


@dataclass(frozen=True)
class HistogramSpec:
    key: str  # its key in a tally and a heartbeat
    name: str
    doc: str
    bounds: tuple[float, ...]


HISTOGRAMS = (
    HistogramSpec("ttft", "vllm:time_to_first_token_seconds",
                  "Time to first token in seconds, from enqueue.", TTFT_BUCKETS),
    HistogramSpec("itl", "vllm:inter_token_latency_seconds",
                  "Inter-token latency in seconds.", ITL_BUCKETS),
    HistogramSpec("tpot", "vllm:request_time_per_output_token_seconds",
                  "Time per output token of each request (decode time / (tokens - 1)).",
                  ITL_BUCKETS),
    HistogramSpec("e2e", "vllm:e2e_request_latency_seconds",
                  "End-to-end request latency in seconds, from enqueue.",
                  REQUEST_LATENCY_BUCKETS),
    HistogramSpec("queue", "vllm:request_queue_time_seconds",
                  "Time from enqueue until a worker started the request.",
                  REQUEST_LATENCY_BUCKETS),
    HistogramSpec("prefill", "vllm:request_prefill_time_seconds",
                  "Time from the request's start on a worker to its first token.",
                  REQUEST_LATENCY_BUCKETS),
    HistogramSpec("decode", "vllm:request_decode_time_seconds",
                  "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS),
    HistogramSpec("inference", "vllm:request_inference_time_seconds",
                  "Time from the request's start on a worker to its end.",
                  REQUEST_LATENCY_BUCKETS),
    HistogramSpec("prompt_len", "vllm:request_prompt_tokens",
                  "Prompt tokens per finished request.", TOKEN_BUCKETS),
    HistogramSpec("gen_len", "vllm:request_generation_tokens",
                  "Generated tokens per finished request.", TOKEN_BUCKETS),
)
TPOT_ALIAS = "vllm:time_per_output_token_seconds"
"""vLLM's name for the inter-token histogram before 0.11; rendered from the same bins."""

COUNTERS = (
    ("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens of the requests served "
     "(counted when a request ends)."),
    ("generation_tokens", "vllm:generation_tokens", "Generated tokens."),
    ("preemptions", "vllm:num_preemptions", "Requests preempted (KV blocks ran out)."),
    ("prefix_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in prompt tokens looked up."),
    ("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in tokens found cached."),
)
_ENCODING = 1


class Bins:
    """One histogram's counts per bucket (not cumulative; the last is ``+Inf``) and sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            running += n
            out.append((floatToGoString(bound), float(running)))
        return out


class EngineTally:
    """What vLLM counts for one engine (here: one worker). Written by one thread (the
    engine loop), read by others (a scrape, the heartbeat): plain stores, no lock."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.counters = {key: 0 for key, _n, _d in COUNTERS}
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.bins = {h.key: Bins(h.bounds) for h in HISTOGRAMS}

    def finished(self, reason: str, ttft_s: float | None, e2e_s: float, queued_s: float,
                 prompt_tokens: int, output_tokens: int) -> None:
        """A request ended (its Ferry finish reason, times from enqueue, token counts)."""
        vllm_reason = _REASON_OF.get(reason)
        if vllm_reason is not None:
            self.success[vllm_reason] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        b = self.bins
        b["e2e"].observe(e2e_s)
        b["queue"].observe(queued_s)
        b["inference"].observe(max(0.0, e2e_s - queued_s))
        b["prompt_len"].observe(prompt_tokens)
        b["gen_len"].observe(output_tokens)
        if ttft_s is not None:
            b["ttft"].observe(ttft_s)
            b["prefill"].observe(max(0.0, ttft_s - queued_s))
            b["decode"].observe(max(0.0, e2e_s - ttft_s))
            if output_tokens > 1:
                b["tpot"].observe(max(0.0, e2e_s - ttft_s) / (output_tokens - 1))

    def encode(self) -> str:
        """The tally as a heartbeat stat (compact JSON; ``decode`` reads it back)."""
        return json.dumps({
            "v": _ENCODING, "g": [self.running, self.waiting, self.kv_usage],
            "c": [self.counters[key] for key, _n, _d in COUNTERS],
            "s": [self.success[r] for r in FINISHED_REASONS],
            "h": {h.key: [*self.bins[h.key].counts, self.bins[h.key].total]
                  for h in HISTOGRAMS},
        }, separators=(",", ":"))

    @classmethod
    def decode(cls, text: object) -> EngineTally | None:
        """A tally from ``encode``'s text; None for anything else (another encoding, a
        malformed or missing stat): the caller leaves that worker out."""
        if not isinstance(text, str):
            return None
        try:
            raw = json.loads(text)
            return cls._from(raw) if raw.get("v") == _ENCODING else None
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    @classmethod
    def _from(cls, raw: dict[str, Any]) -> EngineTally | None:
        tally = cls()
        gauges, counters, success = raw["g"], raw["c"], raw["s"]
        if (len(gauges), len(counters), len(success)) != (3, len(COUNTERS),
                                                         len(FINISHED_REASONS)):
            return None
        tally.running, tally.waiting = int(gauges[0]), int(gauges[1])
        tally.kv_usage = float(gauges[2])
        keys = [key for key, _n, _d in COUNTERS]
        tally.counters = {key: int(n) for key, n in zip(keys, counters, strict=True)}
        tally.success = {r: int(n) for r, n in zip(FINISHED_REASONS, success, strict=True)}
        for h in HISTOGRAMS:
            values = raw["h"][h.key]
            if len(values) != len(h.bounds) + 2:
                return None
            tally.bins[h.key].counts = [int(n) for n in values[:-1]]
            tally.bins[h.key].total = float(values[-1])
        return tally


Engine = tuple[str, str, EngineTally]
"""(model_name, engine, tally): one engine's series."""


def families(engines: Sequence[Engine], queued: Sequence[tuple[str, int]] = ()
             ) -> list[Metric]:
    """vLLM's families for ``engines``; ``queued``: (model_name, requests) waiting in the
    queue for any worker, added to ``vllm:num_requests_waiting`` as ``engine="(queue)"``."""
    return [*_gauges(engines, queued), *_counters(engines), *_histograms(engines)]


def _gauges(engines: Sequence[Engine], queued: Sequence[tuple[str, int]]) -> Iterator[Metric]:
    running = GaugeMetricFamily("vllm:num_requests_running",
                                "Requests in the running batch.", labels=LABELS)
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "Requests waiting: taken by a worker and not yet "
        "running, and (engine=\"(queue)\") those no worker has taken.", labels=LABELS)
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", labels=LABELS)
    legacy = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 "
                               "percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
                               labels=LABELS)
    for model, engine, tally in engines:
        running.add_metric([model, engine], tally.running)
        waiting.add_metric([model, engine], tally.waiting)
        usage.add_metric([model, engine], tally.kv_usage)
        legacy.add_metric([model, engine], tally.kv_usage)
    for model, n in queued:
        waiting.add_metric([model, QUEUE_ENGINE], n)
    yield from (running, waiting, usage, legacy)


def _counters(engines: Sequence[Engine]) -> Iterator[Metric]:
    for key, name, doc in COUNTERS:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        for model, engine, tally in engines:
            family.add_metric([model, engine], tally.counters[key])
        yield family
    success = CounterMetricFamily("vllm:request_success", "Finished requests, by vLLM's "
                                  "finished_reason (cancelled and timed out: abort).",
                                  labels=[*LABELS, "finished_reason"])
    for model, engine, tally in engines:
        for reason in FINISHED_REASONS:
            success.add_metric([model, engine, reason], tally.success[reason])
    yield success


def _histograms(engines: Sequence[Engine]) -> Iterator[Metric]:
    specs = [(h.key, h.name, h.doc) for h in HISTOGRAMS]
    specs.append(("itl", TPOT_ALIAS, "Inter-token latency in seconds. DEPRECATED: use "
                  "vllm:inter_token_latency_seconds."))
    for key, name, doc in specs:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        for model, engine, tally in engines:
            bins = tally.bins[key]
            family.add_metric([model, engine], bins.cumulative(), sum_value=bins.total)
        yield family


class TallyCollector(Collector):
    """A registry's collector of ``families(source())``, read at each scrape."""

    def __init__(self, source: Callable[[], Sequence[Engine]]) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return families(self.source())


class Snapshot(Collector):
    """A registry's collector of families built beforehand (the gateway's fleet view)."""

    def __init__(self, built: list[Metric]) -> None:
        self.built = built

    def collect(self) -> Iterable[Metric]:
        return self.built
