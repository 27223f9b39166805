"""WorkerMetrics: every documented metric is exported, counters never double count.

Each test builds its own registry, as the worker does, so tests cannot leak into each other.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.redis_server import free_port
from worker.service.metrics.prometheus import WorkerMetrics

ROOT = Path(__file__).resolve().parents[4]

EXPECTED = {
    "ferry_worker_queue_depth": "gauge",
    "ferry_worker_queue_lag": "gauge",
    "ferry_worker_requests": "counter",
    "ferry_worker_time_to_first_token_seconds": "histogram",
    "ferry_worker_inter_token_latency_seconds": "histogram",
    "ferry_worker_e2e_latency_seconds": "histogram",
    "ferry_worker_queue_time_seconds": "histogram",
    "ferry_worker_request_output_tokens": "histogram",
    "ferry_worker_output_tokens": "counter",
    "ferry_worker_running_requests": "gauge",
    "ferry_worker_waiting_requests": "gauge",
    "ferry_worker_kv_blocks_used": "gauge",
    "ferry_worker_kv_blocks_free": "gauge",
    "ferry_worker_kv_cache_usage_ratio": "gauge",
    "ferry_worker_preemptions": "counter",
    "ferry_worker_reclaimed": "counter",
    "ferry_worker_dead_letters": "counter",
    "ferry_worker_step_seconds": "histogram",
    "ferry_worker_kv_blocks_cached": "gauge",
    "ferry_worker_prefix_cache_queries": "counter",
    "ferry_worker_prefix_cache_hits": "counter",
    "ferry_worker_prefix_cache_host_hits": "counter",
    "ferry_worker_kv_host_blocks_cached": "gauge",
    "ferry_worker_decode_graphs_active": "gauge",
    "ferry_worker_degraded": "gauge",
    "ferry_worker_spec_drafted_tokens": "counter",
    "ferry_worker_spec_accepted_tokens": "counter",
    "ferry_worker_spec_draft_rows": "counter",
    "ferry_worker_spec_store_rows": "counter",
    "ferry_worker_spec_grammar_cut_tokens": "counter",
}


@dataclass
class Stats:
    """The fields of worker.engine.output.outputs.EngineStats (a copy: no torch import here)."""

    num_running: int = 3
    num_waiting: int = 2
    kv_blocks_total: int = 100
    kv_blocks_free: int = 25
    num_preemptions: int = 0
    tokens_generated: int = 0
    steps: int = 0
    prefix_cache_queries: int = 400
    prefix_cache_hits: int = 300
    kv_blocks_cached: int = 12
    prefix_cache_host_hits: int = 96
    kv_host_blocks_cached: int = 30
    kv_host_blocks_total: int = 500
    degraded: tuple[str, ...] = ()
    decode_graphs_active: bool = False
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_rows: int = 0


def _samples(metrics: WorkerMetrics) -> dict[str, float]:
    """Flatten the exposition into ``{'name{label=value}': value}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _one_request(metrics: WorkerMetrics) -> None:
    metrics.set_queue(depth=7, lag=4)
    metrics.observe_step(0.02, num_tokens=3)
    metrics.observe_inter_token(0.015)
    metrics.set_engine(Stats(tokens_generated=3, num_preemptions=1))
    metrics.reclaimed()
    metrics.dead_lettered(2)
    metrics.request_finished("stop", ttft_s=0.1, e2e_s=0.5, queued_s=0.05, output_tokens=3)


def test_every_metric_is_exported_with_its_type() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    _one_request(metrics)
    families = {
        f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())
    }
    for name, kind in EXPECTED.items():
        assert families.get(name) == kind, f"{name}: {families.get(name)} != {kind}"


def test_values_after_one_request() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    _one_request(metrics)
    s = _samples(metrics)
    assert s["ferry_worker_queue_depth"] == 7
    assert s["ferry_worker_queue_lag"] == 4
    assert s["ferry_worker_requests_total{outcome=stop}"] == 1
    assert s["ferry_worker_requests_total{outcome=error}"] == 0  # pre-created label
    assert s["ferry_worker_output_tokens_total"] == 3
    assert s["ferry_worker_preemptions_total"] == 1
    assert s["ferry_worker_reclaimed_total"] == 1
    assert s["ferry_worker_dead_letters_total"] == 2
    assert s["ferry_worker_running_requests"] == 3
    assert s["ferry_worker_waiting_requests"] == 2
    assert s["ferry_worker_kv_blocks_used"] == 75
    assert s["ferry_worker_kv_blocks_free"] == 25
    assert s["ferry_worker_kv_cache_usage_ratio"] == 0.75
    assert s["ferry_worker_time_to_first_token_seconds_count"] == 1
    assert s["ferry_worker_inter_token_latency_seconds_count"] == 1
    assert s["ferry_worker_e2e_latency_seconds_sum"] == 0.5
    assert s["ferry_worker_queue_time_seconds_count"] == 1
    assert s["ferry_worker_step_seconds_count"] == 1
    assert s["ferry_worker_prefix_cache_queries_total"] == 400
    assert s["ferry_worker_prefix_cache_hits_total"] == 300
    assert s["ferry_worker_kv_blocks_cached"] == 12
    assert s["ferry_worker_prefix_cache_host_hits_total"] == 96
    assert s["ferry_worker_kv_host_blocks_cached"] == 30


def test_step_events_and_engine_totals_do_not_double_count() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    metrics.observe_step(0.01, 4)
    metrics.preempted(1)
    metrics.set_engine(Stats(tokens_generated=4, num_preemptions=1))  # same events again
    metrics.set_engine(Stats(tokens_generated=10, num_preemptions=3))  # 6 and 2 more
    metrics.observe_step(0.01, 2)
    s = _samples(metrics)
    assert s["ferry_worker_output_tokens_total"] == 12
    assert s["ferry_worker_preemptions_total"] == 3


def test_missing_ttft_and_empty_kv_pool() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    metrics.set_engine(Stats(kv_blocks_total=0, kv_blocks_free=0))
    metrics.request_finished("cancelled", None, e2e_s=1.0, queued_s=1.0, output_tokens=0)
    s = _samples(metrics)
    assert s["ferry_worker_kv_cache_usage_ratio"] == 0
    assert s["ferry_worker_time_to_first_token_seconds_count"] == 0
    assert s["ferry_worker_requests_total{outcome=cancelled}"] == 1


def test_two_workers_in_one_process_do_not_collide() -> None:
    a, b = WorkerMetrics(), WorkerMetrics()
    a.dead_lettered()
    assert _samples(b)["ferry_worker_dead_letters_total"] == 0


def test_serve_exposes_metrics_over_http() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    metrics.serve(0)  # disabled: no server, no error
    port = free_port()
    metrics.serve(port)
    _one_request(metrics)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    for name in EXPECTED:
        assert name in body


def test_degraded_states_and_graphs_are_gauges() -> None:
    """Healthy: every reason exported at 0. Degraded: 1 for its reasons, and back to 0
    when a reason clears (a fresh engine after a restart)."""
    metrics = WorkerMetrics(CollectorRegistry())
    metrics.set_engine(Stats(decode_graphs_active=True))
    s = _samples(metrics)
    assert s["ferry_worker_decode_graphs_active"] == 1
    reasons = {k: v for k, v in s.items() if k.startswith("ferry_worker_degraded{")}
    assert len(reasons) == 5 and set(reasons.values()) == {0}
    metrics.set_engine(Stats(degraded=("decode_graphs_unavailable",)))
    s = _samples(metrics)
    assert s["ferry_worker_degraded{reason=decode_graphs_unavailable}"] == 1
    assert s["ferry_worker_degraded{reason=cpu_attention_fallback}"] == 0
    assert s["ferry_worker_decode_graphs_active"] == 0
    metrics.set_engine(Stats())
    assert _samples(metrics)["ferry_worker_degraded{reason=decode_graphs_unavailable}"] == 0


def test_speculative_counters_follow_the_engine() -> None:
    from worker.engine.engine_stats import EngineStats  # a plain dataclass: no torch

    metrics = WorkerMetrics(CollectorRegistry())
    base = dict(num_running=1, num_waiting=0, kv_blocks_total=8, kv_blocks_free=8,
                num_preemptions=0, tokens_generated=0, steps=0)
    metrics.set_engine(EngineStats(**base, spec_drafted_tokens=40,  # type: ignore[arg-type]
                                   spec_accepted_tokens=25, spec_draft_rows=10))
    stats = EngineStats(**base, spec_drafted_tokens=48,  # type: ignore[arg-type]
                        spec_accepted_tokens=30, spec_draft_rows=12, spec_store_rows=5,
                        spec_grammar_cut_tokens=7)
    assert stats.spec_mean_acceptance_length == 3.5
    metrics.set_engine(stats)
    s = _samples(metrics)
    assert (s["ferry_worker_spec_drafted_tokens_total"],
            s["ferry_worker_spec_accepted_tokens_total"],
            s["ferry_worker_spec_draft_rows_total"], s["ferry_worker_spec_store_rows_total"],
            s["ferry_worker_spec_grammar_cut_tokens_total"]) == (48, 30, 12, 5, 7)


def test_metrics_module_imports_without_torch() -> None:
    """``import worker.service.metrics.prometheus`` through its packages: their ``__init__`` files
    stay
    lazy, so the metrics endpoint and ``ferry top`` never load a GPU stack."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any 'import torch' now raises ImportError
        "from worker.service.metrics.prometheus import WorkerMetrics\n"
        "WorkerMetrics().observe_step(0.1, 1)\n"
        "import worker\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    assert importlib.util.find_spec("prometheus_client") is not None


def test_gaps_binned_in_an_output_process_export_like_observed_ones() -> None:
    """``FERRY_OUTPUT_PROCESS``: inter-token gaps are binned there (``GapBins``) and added
    here once per pass; both histograms (Ferry's and vLLM's, on other bounds) read exactly
    as if each had been observed."""
    from worker.service.metrics.prometheus import GapBins

    gaps = [0.001, 0.002, 0.0021, 0.05, 0.3, 1.0, 7.5, 0.015]
    observed, binned = WorkerMetrics(CollectorRegistry()), WorkerMetrics(CollectorRegistry())
    bins = GapBins()
    for g in gaps:
        observed.observe_inter_token(g)
        bins.observe_inter_token(g)
    taken = bins.take()
    assert taken is not None and bins.take() is None
    binned.add_inter_token(*taken)

    def itl(m: WorkerMetrics) -> dict[str, float]:
        return {k: v for k, v in _samples(m).items() if "inter_token" in k and "_created" not in k}

    assert itl(binned) == itl(observed) and itl(observed)
    assert any(k.startswith("vllm:inter_token_latency_seconds_bucket") for k in itl(observed))


def test_vllm_names_count_what_the_worker_served() -> None:
    """vLLM's names beside Ferry's, labelled with the served model and the worker id; the
    heartbeat's tally reads the same as the port."""
    from observability.vllm_metrics import EngineTally

    metrics = WorkerMetrics(CollectorRegistry())
    metrics.bind("tiny", "w1")
    _one_request(metrics)
    metrics.request_finished("cancelled", None, e2e_s=2.0, queued_s=2.0, output_tokens=0,
                             prompt_tokens=5)
    metrics.request_finished("length", 0.2, e2e_s=1.0, queued_s=0.1, output_tokens=8,
                             prompt_tokens=12)
    beat = metrics.vllm_heartbeat(running=3, waiting=6, kv_usage=0.75)
    s = _samples(metrics)
    w1 = "engine=w1,model_name=tiny"
    assert s[f"vllm:prompt_tokens_total{{{w1}}}"] == 17  # _one_request's gave none
    assert s[f"vllm:generation_tokens_total{{{w1}}}"] == s["ferry_worker_output_tokens_total"]
    assert s[f"vllm:num_preemptions_total{{{w1}}}"] == 1
    assert s[f"vllm:prefix_cache_queries_total{{{w1}}}"] == 400
    assert s[f"vllm:prefix_cache_hits_total{{{w1}}}"] == 300
    success = "vllm:request_success_total{{engine=w1,finished_reason={},model_name=tiny}}"
    assert s[success.format("abort")] == 1 and s[success.format("length")] == 1
    assert s[success.format("stop")] == 1  # _one_request's
    assert s[f"vllm:num_requests_waiting{{{w1}}}"] == 6
    assert s[f"vllm:kv_cache_usage_perc{{{w1}}}"] == 0.75
    assert s[f"vllm:inter_token_latency_seconds_count{{{w1}}}"] == 1
    decoded = EngineTally.decode(beat)
    assert decoded is not None and decoded.counters == metrics.vllm.counters
    assert decoded.success == metrics.vllm.success


def test_vllm_counters_stay_monotonic_across_an_engine_restart() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    metrics.set_engine(Stats(tokens_generated=10, prefix_cache_queries=50))
    metrics.set_engine(Stats(tokens_generated=0, prefix_cache_queries=0))  # a fresh engine
    metrics.set_engine(Stats(tokens_generated=3, prefix_cache_queries=8))
    s = _samples(metrics)
    assert s["vllm:generation_tokens_total{engine=0,model_name=ferry}"] == 13
    assert s["vllm:prefix_cache_queries_total{engine=0,model_name=ferry}"] == 58
    assert s["ferry_worker_output_tokens_total"] == 13
