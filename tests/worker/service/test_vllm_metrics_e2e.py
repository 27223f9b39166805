"""vLLM's metric names on a real stack (a ``ferry worker`` on the default model, a gateway,
Redis): a worker's ``vllm:*`` counters count the requests it served, the gateway's fleet
view shows the same series from the heartbeats, and every metric the shipped Grafana
dashboards query is exported by the gateway or the worker.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.redis_server import free_port
from tests.worker.service.procs import WorkerProcess
from worker.models import default_model_path

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((ROOT / "ops" / "grafana" / "dashboards").glob("*.json"))
WORKER = "vllm-1"


@pytest.fixture(scope="module")
def stack(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    with WorkerProcess(default_model_path(), redis_server.url, WORKER, log_dir,
                       "--metrics-port", str(free_port())) as worker:
        beat = worker.wait_live().heartbeat()
        assert beat is not None
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            yield SimpleNamespace(worker=worker, url=gateway.url,
                                  metrics=f"http://127.0.0.1:{beat.stats['metrics_port']}")


def _scrape(url: str) -> tuple[dict[str, str], dict[tuple[str, frozenset[Any]], float]]:
    """(family name -> type, (sample name, labels) -> value) of one ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    kinds, values = {}, {}
    for family in text_string_to_metric_families(text):
        kinds[family.name] = family.type
        for s in family.samples:
            values[(s.name, frozenset(s.labels.items()))] = s.value
    return kinds, values


def _total(values: dict[tuple[str, frozenset[Any]], float], name: str) -> float:
    """A metric summed over this worker's series (every label value)."""
    return sum(v for (n, labels), v in values.items()
               if n == name and ("engine", WORKER) in labels)


def test_the_worker_counts_what_it_served_and_the_gateway_shows_it(stack: Any) -> None:
    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:request_success_total", "vllm:e2e_request_latency_seconds_count")
    _, before = _scrape(stack.metrics)
    usage = []
    for prompt in ("The capital of France is", "Once upon a time, in a land far away, there",
                   "1, 2, 3,"):
        answer = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200, answer.text
        usage.append(answer.json()["usage"])
    want = {"vllm:prompt_tokens_total": sum(u["prompt_tokens"] for u in usage),
            "vllm:generation_tokens_total": sum(u["completion_tokens"] for u in usage),
            "vllm:request_success_total": 3, "vllm:e2e_request_latency_seconds_count": 3}
    deadline = time.monotonic() + 30  # the terminal events may reach the client first
    while True:
        _, after = _scrape(stack.metrics)
        got = {n: _total(after, n) - _total(before, n) for n in names}
        if got["vllm:request_success_total"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == want
    stack.worker.heartbeat_after(time.time())
    _, fleet = _scrape(stack.url)
    _, mine = _scrape(stack.metrics)
    for name in names:
        assert _total(fleet, name) == _total(mine, name), name
    waiting = [v for (n, labels), v in fleet.items() if n == "vllm:num_requests_waiting"
               and ("engine", "(queue)") in labels]
    assert waiting == [0]


_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The metric names a dashboard's PromQL (panels and variables) refers to."""
    exprs = [t.get("expr", "") for p in dashboard.get("panels", [])
             for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard.get("templating", {}).get("list", [])
              if v.get("definition")]
    found = set()
    for expr in exprs:
        expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # matchers, ranges
        expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ",
                      expr)  # label lists
        for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
            name = match.group(0)
            if name not in _NOT_METRICS and not expr[match.end():].lstrip().startswith("("):
                found.add(name)
    return found - {"label_values", "model_name"}


def _exported(kinds: dict[str, str]) -> set[str]:
    """Every sample name the families declare (a labelled family with no child yet is
    declared all the same: its name is exported)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("_sum", "_count", "")}
    return {name + s for name, kind in kinds.items() for s in suffixes.get(kind, ("",))}


def test_every_metric_the_dashboards_query_is_exported(stack: Any) -> None:
    assert {p.name for p in DASHBOARDS} >= {"ferry.json", "ferry-vllm.json"}
    exported = _exported(_scrape(stack.url)[0]) | _exported(_scrape(stack.metrics)[0])
    for path in DASHBOARDS:
        wanted = dashboard_metrics(json.loads(path.read_text()))
        assert wanted and all(n.startswith(("ferry_", "vllm:")) for n in wanted), wanted
        assert not wanted - exported, f"{path.name} queries {sorted(wanted - exported)}"


def test_the_vllm_dashboard_covers_the_vllm_names() -> None:
    wanted = dashboard_metrics(json.loads((ROOT / "ops/grafana/dashboards/ferry-vllm.json")
                                          .read_text()))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "ferry_worker_tenant_tokens_total"):
        assert name in wanted, name
