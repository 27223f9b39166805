"""vLLM's metric names as Ferry renders them: the names, types, label names and buckets
vLLM's own Prometheus logger declares (``vllm/v1/metrics/loggers.py``), so a dashboard or
rule written for vLLM reads Ferry's series as it reads vLLM's; and the heartbeat encoding
the gateway's fleet view is built from.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from observability.vllm_metrics import (
    QUEUE_ENGINE,
    EngineTally,
    Snapshot,
    TallyCollector,
    families,
)

# vLLM's declarations (loggers.py): name -> (type, label names beyond model_name/engine)
VLLM = {
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:gpu_cache_usage_perc": ("gauge", set()),
    "vllm:prompt_tokens": ("counter", set()),
    "vllm:generation_tokens": ("counter", set()),
    "vllm:num_preemptions": ("counter", set()),
    "vllm:prefix_cache_queries": ("counter", set()),
    "vllm:prefix_cache_hits": ("counter", set()),
    "vllm:request_success": ("counter", {"finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", set()),
    "vllm:inter_token_latency_seconds": ("histogram", set()),
    "vllm:time_per_output_token_seconds": ("histogram", set()),
    "vllm:request_time_per_output_token_seconds": ("histogram", set()),
    "vllm:e2e_request_latency_seconds": ("histogram", set()),
    "vllm:request_queue_time_seconds": ("histogram", set()),
    "vllm:request_prefill_time_seconds": ("histogram", set()),
    "vllm:request_decode_time_seconds": ("histogram", set()),
    "vllm:request_inference_time_seconds": ("histogram", set()),
    "vllm:request_prompt_tokens": ("histogram", set()),
    "vllm:request_generation_tokens": ("histogram", set()),
}
# vLLM's bucket bounds where dashboards' quantiles depend on them
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
       10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
BOUNDS = {"vllm:time_to_first_token_seconds": TTFT, "vllm:inter_token_latency_seconds": ITL,
          "vllm:time_per_output_token_seconds": ITL,
          "vllm:e2e_request_latency_seconds": LATENCY,
          "vllm:request_queue_time_seconds": LATENCY}


def _render(*engines: tuple[str, str, EngineTally], queued: int | None = None) -> str:
    registry = CollectorRegistry()
    built = families(list(engines), [] if queued is None else [("m", queued)])
    registry.register(Snapshot(built))
    return generate_latest(registry).decode()


def _tally() -> EngineTally:
    t = EngineTally()
    t.running, t.waiting, t.kv_usage = 4, 2, 0.5
    t.counters["generation_tokens"] = 40
    t.finished("stop", ttft_s=0.07, e2e_s=1.2, queued_s=0.02, prompt_tokens=9,
               output_tokens=21)
    t.finished("timeout", ttft_s=None, e2e_s=30.0, queued_s=30.0, prompt_tokens=5,
               output_tokens=0)
    t.bins["itl"].observe(0.03)
    return t


def test_names_types_labels_and_buckets_are_vllms() -> None:
    text = _render(("m", "w1", _tally()))
    found = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, extra) in VLLM.items():
        family = found.get(name)
        assert family is not None and family.type == kind, (name, family)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == {"model_name", "engine", *extra}, sample
        if name in BOUNDS:
            bounds = [float(s.labels["le"]) for s in family.samples
                      if s.name == f"{name}_bucket"]
            assert bounds == [*BOUNDS[name], float("inf")], name
    assert "vllm:prompt_tokens_total{" in text and "vllm:request_success_total{" in text


def test_values_of_one_engine() -> None:
    text = _render(("m", "w1", _tally()), queued=6)
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for f in text_string_to_metric_families(text) for x in f.samples}
    w1 = (("engine", "w1"), ("model_name", "m"))
    assert s[("vllm:num_requests_running", w1)] == 4
    assert s[("vllm:num_requests_waiting", w1)] == 2
    assert s[("vllm:num_requests_waiting", (("engine", QUEUE_ENGINE), ("model_name", "m")))] == 6
    assert s[("vllm:prompt_tokens_total", w1)] == 14
    assert s[("vllm:generation_tokens_total", w1)] == 40
    assert s[("vllm:request_success_total", (*w1[:1], ("finished_reason", "abort"),
                                             *w1[1:]))] == 1  # a timeout is vLLM's abort
    assert s[("vllm:request_success_total", (*w1[:1], ("finished_reason", "stop"),
                                             *w1[1:]))] == 1
    assert s[("vllm:e2e_request_latency_seconds_count", w1)] == 2
    assert s[("vllm:time_to_first_token_seconds_count", w1)] == 1  # the timeout had none
    assert s[("vllm:request_decode_time_seconds_sum", w1)] == 1.2 - 0.07
    assert s[("vllm:request_prefill_time_seconds_sum", w1)] == 0.07 - 0.02
    assert abs(s[("vllm:request_time_per_output_token_seconds_sum", w1)]
               - (1.2 - 0.07) / 20) < 1e-12
    assert s[("vllm:inter_token_latency_seconds_bucket", (*w1[:1], ("le", "0.05"),
                                                          *w1[1:]))] == 1
    assert s[("vllm:time_per_output_token_seconds_count", w1)] == 1  # the same bins


def test_the_heartbeat_encoding_round_trips_and_refuses_garbage() -> None:
    tally = _tally()
    back = EngineTally.decode(tally.encode())
    assert back is not None
    assert _render(("m", "w1", back)) == _render(("m", "w1", tally))
    assert len(tally.encode()) < 2500  # a heartbeat a second: keep it small
    for bad in (None, 3, "", "[]", "{}", '{"v":99}', tally.encode().replace('"c":[', '"c":[1,'),
                tally.encode().replace('"ttft":[', '"ttft":[0,')):
        assert EngineTally.decode(bad) is None, bad


def test_prometheus_client_accepts_colon_names() -> None:
    """The names are legal Prometheus names and prometheus-client's own classes take them."""
    registry = CollectorRegistry()
    Counter("vllm:colon_check", "x", ["model_name"], registry=registry).labels("m").inc(3)
    registry.register(TallyCollector(lambda: [("m", "w1", _tally())]))
    text = generate_latest(registry).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"vllm:colon_check", "vllm:prompt_tokens", "vllm:num_requests_waiting"} <= names
