"""docker-compose.yml and the monitoring files: valid, scalable, durable Redis, dashboards.

``docker compose config`` (or the v1 ``docker-compose config``) validates the file where a
compose client is installed; it needs no Docker engine. The structural checks below run
everywhere.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.ops import deploy_files as files
from worker.service.metrics import WorkerMetrics

SERVICES: dict[str, Any] = files.compose()["services"]


def _compose_client() -> list[str] | None:
    """``docker compose`` (plugin) if it works without an engine, else ``docker-compose``."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return cmd
    return None


def test_compose_config_validates() -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("no compose client: neither `docker compose` nor `docker-compose` runs here")
    profiles = ["--profile", "cpu", "--profile", "monitoring"]
    out = subprocess.run([*client, "-f", str(files.COMPOSE), *profiles, "config"],
                         capture_output=True, text=True, timeout=120, cwd=files.ROOT)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    assert set(resolved) == set(SERVICES)
    assert resolved["worker"]["deploy"]["replicas"] == 1  # ${FERRY_WORKERS:-1}, as a number


def test_redis_is_durable_and_never_evicts() -> None:
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "everysec"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "redis-data:/data" in redis["volumes"]
    assert "redis-data" in files.compose()["volumes"]


def test_gateway_service() -> None:
    gateway = SERVICES["gateway"]
    assert gateway["command"][:2] == ["ferry", "gateway"]
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["build"]["dockerfile"] == "ops/docker/gateway.Dockerfile"


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_scale_freely(name: str) -> None:
    """`--scale worker=N` needs no fixed name and no host port; drain needs a grace period."""
    worker = SERVICES[name]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["shm_size"] == "2gb"
    assert any(v.startswith("hf-cache:") for v in worker["volumes"])
    assert any(v.endswith(":/models:ro") for v in worker["volumes"])
    assert worker["stop_grace_period"] == "10m"
    drain = int(worker["command"][worker["command"].index("--drain-timeout-s") + 1])
    assert drain < 600  # SIGKILL comes at 10 min
    assert worker["environment"]["HF_HOME"] == "/cache/huggingface"


def test_gpu_worker_reserves_one_gpu_and_cpu_worker_none() -> None:
    deploy = SERVICES["worker"]["deploy"]
    assert deploy["replicas"] == "${FERRY_WORKERS:-1}"
    devices = deploy["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "profiles" not in SERVICES["worker"]
    cpu = SERVICES["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "resources" not in cpu.get("deploy", {})
    assert cpu["environment"]["FERRY_DEVICE"] == "cpu"


def test_monitoring_profile() -> None:
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"]
    prom = yaml.safe_load((files.ROOT / "ops/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    dns = jobs["ferry-worker"]["dns_sd_configs"][0]
    assert set(dns["names"]) == {"worker", "worker-cpu"} and dns["port"] == 9100
    grafana = files.ROOT / "ops/grafana/provisioning"
    datasource = yaml.safe_load((grafana / "datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((grafana / "dashboards/ferry.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f":{path}:ro") for v in SERVICES["grafana"]["volumes"])


def test_dashboard_shows_every_worker_metric() -> None:
    dashboard = json.loads((files.ROOT / "ops/grafana/dashboards/ferry.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    uid = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uid == {"ferry-prometheus"}
    metrics = WorkerMetrics(CollectorRegistry())
    names = {m.name for m in metrics.registry.collect()}
    assert len(names) >= 15
    missing = sorted(n for n in names if n not in exprs)
    assert not missing, f"metrics without a dashboard panel: {missing}"
