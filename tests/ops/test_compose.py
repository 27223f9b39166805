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
from worker.service.metrics.prometheus import PREFIX, WorkerMetrics

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
    profiles = ["--profile", "cpu", "--profile", "monitoring", "--profile", "tp"]
    out = subprocess.run([*client, "-f", str(files.COMPOSE), *profiles, "config"],
                         capture_output=True, text=True, timeout=120, cwd=files.ROOT)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    assert set(resolved) == set(SERVICES)
    assert resolved["worker"]["deploy"]["replicas"] == 1  # ${FERRY_WORKERS:-1}, as a number


def test_redis_is_durable_and_never_evicts() -> None:
    redis = SERVICES["redis"]
    assert redis["image"] == "${FERRY_REDIS_IMAGE:-redis:7.2-alpine}"
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "everysec"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    assert cmd[cmd.index("--dir") + 1] == "/data"  # any Redis image, not only the official
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "redis-data:/data" in redis["volumes"]
    assert "redis-data" in files.compose()["volumes"]


def test_gateway_service() -> None:
    gateway = SERVICES["gateway"]
    assert gateway["command"][:2] == ["ferry", "gateway"]
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert "FERRY_PORT" in " ".join(gateway["healthcheck"]["test"])  # follows the port
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["build"]["dockerfile"] == "ops/docker/gateway.Dockerfile"


# service -> build args that must be compose parameters, with today's public defaults
BUILD_PARAMETERS = {
    "gateway": {"PYTHON_IMAGE": "${FERRY_PYTHON_IMAGE:-python:3.11-slim}"},
    "worker": {"CUDA_IMAGE": "${FERRY_CUDA_IMAGE:-nvidia/cuda:12.6.3-runtime-ubuntu24.04}",
               "TORCH_SPEC": "${FERRY_TORCH_SPEC:-torch>=2.4,<2.16}"},
    "worker-cpu": {"PYTHON_IMAGE": "${FERRY_PYTHON_IMAGE:-python:3.11-slim}",
                   "TORCH_SPEC": "${FERRY_TORCH_SPEC:-torch>=2.4,<2.16}",
                   "TORCH_INDEX_URL": "${FERRY_TORCH_INDEX_URL:-}"},
}


@pytest.mark.parametrize("name", sorted(BUILD_PARAMETERS))
def test_base_images_and_torch_are_parameters(name: str) -> None:
    build = SERVICES[name]["build"]
    assert build["args"] == BUILD_PARAMETERS[name]
    dockerfile = (files.ROOT / build["dockerfile"]).read_text()
    for arg in build["args"]:
        assert f"ARG {arg}" in dockerfile, f"{build['dockerfile']} ignores {arg}"


@pytest.mark.parametrize("dockerfile", sorted(files.DOCKER.glob("*.Dockerfile")))
def test_dockerfiles_build_offline_with_any_builder(dockerfile: Any) -> None:
    """No frontend image to pull, no BuildKit-only syntax, pip configurable per build."""
    text = dockerfile.read_text()
    assert not text.startswith("# syntax=")  # a parser directive: pulls a frontend image
    instructions = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in instructions if "--mount=" in line]
    for arg in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_TRUSTED_HOST"):
        assert f"ARG {arg}" in text


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_scale_freely(name: str) -> None:
    """`--scale worker=N` needs no fixed name and no host port; drain needs a grace period."""
    worker = SERVICES[name]
    env = worker["environment"]
    assert "container_name" not in worker and "ports" not in worker
    assert any(v.startswith("hf-cache:") for v in worker["volumes"])
    assert any(v.endswith(":/models:ro") for v in worker["volumes"])
    assert worker["stop_grace_period"] == "10m"
    assert int(env["FERRY_DRAIN_TIMEOUT_S"]) < 600  # SIGKILL comes at 10 min
    assert env["HF_HOME"] == "/cache/huggingface"
    assert "FERRY_HEALTH_FILE" in " ".join(worker["healthcheck"]["test"])  # no port in it


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_serve_the_embedded_model_unless_one_is_named(name: str) -> None:
    worker = SERVICES[name]
    assert "--model" not in worker["command"]
    assert worker["environment"]["FERRY_MODEL"] == "${FERRY_MODEL:-}"  # empty: embedded


def test_one_served_model_name_everywhere() -> None:
    """The gateway is never told a name derived from FERRY_MODEL (a path there once gave
    it '/models/x' while the worker advertised 'x'): both read the one variable, and
    without it the gateway answers to what the workers advertise."""
    for name in ("gateway", "worker", "worker-cpu"):
        env = SERVICES[name]["environment"]
        assert env["FERRY_SERVED_MODEL_NAME"] == "${FERRY_SERVED_MODEL_NAME:-}"
        assert "FERRY_MODEL" not in str(SERVICES[name]["command"])


def test_gpu_worker_reserves_one_gpu_and_cpu_worker_none() -> None:
    deploy = SERVICES["worker"]["deploy"]
    assert deploy["replicas"] == "${FERRY_WORKERS:-1}"
    devices = deploy["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "profiles" not in SERVICES["worker"] and SERVICES["worker"]["shm_size"] == "2gb"
    cpu = SERVICES["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "resources" not in cpu.get("deploy", {})
    assert cpu["environment"]["FERRY_DEVICE"] == "cpu"
    assert cpu["build"]["dockerfile"] == "ops/docker/worker-cpu.Dockerfile"


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_tensor_parallel_examples_reserve_as_many_gpus_as_ranks() -> None:
    """The compose profile ``tp`` and ops/k8s/worker-tp.yaml: one worker owning several
    GPUs, as many reserved as it has ranks, eager (graphs are refused under TP), with a
    /dev/shm for NCCL; the plain GPU worker stays at one GPU and size 1."""
    tp = SERVICES["worker-tp"]
    env = tp["environment"]
    devices = tp["deploy"]["resources"]["reservations"]["devices"]
    assert tp["profiles"] == ["tp"] and tp["command"] == ["ferry", "worker"]
    assert devices[0]["count"] == int(env["FERRY_TENSOR_PARALLEL_SIZE"]) == 2
    assert env["FERRY_ENFORCE_EAGER"] == "1" and tp["shm_size"] == "8gb"
    assert tp["deploy"]["replicas"] == "${FERRY_TP_WORKERS:-1}"
    assert "FERRY_TENSOR_PARALLEL_SIZE" not in SERVICES["worker"]["environment"]
    pods = {doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
            for _, doc in files.k8s_docs() if doc.get("kind") == "Deployment"}
    for name, gpus in (("ferry-worker", 1), ("ferry-worker-tp", 2)):
        container = pods[name]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus, name
        assert int(_env(container).get("FERRY_TENSOR_PARALLEL_SIZE") or 1) == gpus, name
    assert _env(pods["ferry-worker-tp"]["containers"][0])["FERRY_ENFORCE_EAGER"] == "1"
    shm = [v for v in pods["ferry-worker-tp"]["volumes"] if v["name"] == "dshm"]
    assert shm[0]["emptyDir"]["medium"] == "Memory"


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
    names = {m.name for m in metrics.registry.collect() if m.name.startswith(PREFIX)}
    assert len(names) >= 15
    missing = sorted(n for n in names if n not in exprs)
    assert not missing, f"metrics without a dashboard panel: {missing}"


def test_vllm_dashboard_shows_every_vllm_name() -> None:
    """Every ``vllm:*`` family a worker exports has a panel on the vLLM-names dashboard,
    except vLLM's older names for the same data; its queries name the datasource by the
    dashboard's ``datasource`` variable, so any Grafana can import it."""
    dashboard = json.loads((files.ROOT / "ops/grafana/dashboards/ferry-vllm.json").read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs = " ".join(t["expr"] for t in targets)
    assert {t["datasource"]["uid"] for t in targets} == {"${datasource}"}
    names = {m.name for m in WorkerMetrics(CollectorRegistry()).registry.collect()
             if m.name.startswith("vllm:")}
    aliases = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}
    assert len(names) >= 15 and aliases <= names
    missing = sorted(n for n in names - aliases if n not in exprs)
    assert not missing, f"vLLM names without a dashboard panel: {missing}"
