"""The Kubernetes overlay for a Redis Cluster (``ops/k8s-cluster``): KEDA sums the lag of
every shard's every lane, and the gateway and workers run in cluster mode."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from protocol.cluster.keys import ClusterKeys
from protocol.tenants import fair

OVERLAY = Path(__file__).resolve().parents[2] / "ops" / "k8s-cluster"


def _shards() -> int:
    text = (OVERLAY / "kustomization.yaml").read_text()
    found = re.search(r'name: FERRY_STREAM_SHARDS, value: "(\d+)"', text)
    assert found is not None, "the overlay must set FERRY_STREAM_SHARDS"
    return int(found[1])


def test_keda_triggers_name_every_stream_of_every_shard() -> None:
    spec: dict[str, Any] = yaml.safe_load((OVERLAY / "keda.yaml").read_text())["spec"]
    keys = ClusterKeys("ferry", _shards())
    triggers = spec["triggers"]
    lanes, waiting = triggers[:len(keys.request_streams)], triggers[len(keys.request_streams):]
    assert [t["metadata"]["stream"] for t in lanes] == list(keys.request_streams)
    assert [t["metadata"]["stream"] for t in waiting] == [fair.bell(s)
                                                          for s in keys.request_streams]
    for trigger in lanes:
        assert trigger["type"] == "redis-cluster-streams"
        assert trigger["metadata"]["consumerGroup"] == keys.group
        assert int(trigger["metadata"]["lagCount"]) > 0
    for trigger in waiting:  # the fair backlogs' depth (protocol/tenants/fair.py)
        assert trigger["type"] == "redis-cluster-streams"
        assert "consumerGroup" not in trigger["metadata"]
        assert int(trigger["metadata"]["streamLength"]) > 0
    formula = spec["advanced"]["scalingModifiers"]["formula"]
    assert sorted(formula.replace(" ", "").split("+")) == sorted(t["name"] for t in triggers)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_overlay_renders_cluster_mode_without_the_single_redis() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    for name in ("ferry-gateway", "ferry-worker"):
        deployment = next(d for d in docs if d["kind"] == "Deployment"
                          and d["metadata"]["name"] == name)
        env = {e["name"]: e.get("value") for e in
               deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["FERRY_REDIS_CLUSTER"] == "1" and env["FERRY_STREAM_SHARDS"] == str(_shards())
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis-cluster-streams"}
