"""Deployment files agree with the code: real commands and flags, real env vars, real names.

Compose, Kubernetes and the Dockerfiles are text the code never imports, so nothing else
would notice a renamed flag or variable until a deployment failed at start-up.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.tenants import fair
from tests.ops import deploy_files as files

COMMANDS = files.command_lines()
K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _ferry_commands() -> dict[str, Any]:
    """Subcommand name -> the (typer-vendored) click command typer builds for it."""
    from ferry.cli import app

    return dict(getattr(typer.main.get_command(app), "commands", {}))


def test_every_deployment_file_runs_ferry() -> None:
    sources = {c.source.split(":")[0] for c in COMMANDS}
    assert {"docker-compose.yml", "gateway.yaml", "worker.yaml", "batcher.yaml",
            "worker.Dockerfile", "gateway.Dockerfile"} <= sources
    subcommands = {c.argv[1] for c in COMMANDS}
    assert subcommands == {"worker", "gateway", "batcher"}


@pytest.mark.parametrize("line", COMMANDS, ids=str)
def test_command_line_parses_with_the_real_cli(line: files.CommandLine) -> None:
    """Parse the argv with the click command typer builds: unknown flags, bad ints fail."""
    sub = line.argv[1]
    command = _ferry_commands().get(sub)
    if command is None:
        pytest.skip(f"`ferry {sub}` is not registered in ferry/cli.py yet; cannot check {line}")
    args = [K8S_VAR.sub("placeholder", a) for a in line.argv[2:]]  # $(VAR): k8s expands it
    try:
        command.make_context(f"ferry {sub}", args, resilient_parsing=False)
    except Exception as exc:  # typer vendors click: its exception classes are private
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0:
            return
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        pytest.fail(f"{line}: {message}")


@pytest.mark.parametrize("line", COMMANDS, ids=str)
def test_k8s_arg_variables_are_defined(line: files.CommandLine) -> None:
    """``$(VAR)`` in a container's args expands only if the container sets VAR."""
    wanted = {m for a in line.argv for m in K8S_VAR.findall(a)}
    if not wanted:
        return
    env = {e["name"] for src, c in files.k8s_containers() if src == line.source
           for e in c.get("env", [])}
    assert wanted <= env, f"{line}: {wanted - env} not in the container's env"


def test_env_vars_set_by_deployments_are_read_by_the_code() -> None:
    read = files.env_read_by_code()
    unknown = {v: sorted(w) for v, w in files.env_set_by_deployments().items() if v not in read}
    assert not unknown, f"set in deployment files but read nowhere in the code: {unknown}"


def test_every_env_var_the_code_reads_is_documented() -> None:
    doc = files.DOCS.read_text()
    missing = sorted(v for v in files.env_read_by_code() if f"`{v}`" not in doc)
    assert not missing, f"add these to the variables table in docs/operations.md: {missing}"


def test_compose_interpolations_are_documented() -> None:
    doc = files.DOCS.read_text()
    missing = sorted(v for v in files.compose_interpolations() if f"`{v}`" not in doc)
    assert not missing, f"document these compose variables in docs/operations.md: {missing}"


def _scaled_object() -> dict[str, Any]:
    for _, doc in files.k8s_docs():
        if doc["kind"] == "ScaledObject":
            return doc  # type: ignore[no-any-return]
    raise AssertionError("no ScaledObject in ops/k8s")


def test_keda_scales_on_every_lane_and_our_group() -> None:
    """Two redis-streams triggers per priority lane: its group lag (entries XADDed straight
    into it) and the length of its fair backlog's bell (requests waiting in the tenants'
    backlogs, ``protocol/tenants/fair.py``), all summed by the formula."""
    spec = _scaled_object()["spec"]
    keys = Keys(GatewaySettings().prefix)
    triggers = spec["triggers"]
    lanes, waiting = triggers[:3], triggers[3:]
    assert [t["metadata"]["stream"] for t in lanes] == list(keys.request_streams)
    assert [t["metadata"]["stream"] for t in waiting] == [fair.bell(s)
                                                          for s in keys.request_streams]
    for trigger in waiting:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and "consumerGroup" not in meta
        assert int(meta["streamLength"]) > 0 and meta["address"].split(".")[0] == "ferry-redis"
    for trigger in lanes:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and meta["consumerGroup"] == keys.group
        assert int(meta["lagCount"]) > 0 and "pendingEntriesCount" not in meta
        assert meta["address"].split(".")[0] == "ferry-redis"  # the Service in redis.yaml
    formula = spec["advanced"]["scalingModifiers"]["formula"]
    assert sorted(formula.replace(" ", "").split("+")) == sorted(t["name"] for t in triggers)
    trigger = triggers[0]
    names = {(d["kind"], d["metadata"]["name"]) for _, d in files.k8s_docs()}
    assert ("TriggerAuthentication", trigger["authenticationRef"]["name"]) in names


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_ports_agree_everywhere() -> None:
    """Gateway 8000 and worker metrics 9100 in compose, k8s, Prometheus and the images; the
    batcher listens on nothing."""
    import inspect

    from gateway.main import serve

    gateway_port = str(inspect.signature(serve).parameters["port"].default)
    for line in COMMANDS:
        if line.argv[1] == "gateway":
            assert files.setting(line, "--port") == gateway_port, line
        elif line.argv[1] == "worker":
            assert files.setting(line, "--metrics-port") == "9100", line
    services = files.compose()["services"]
    assert services["gateway"]["ports"] == [f"${{FERRY_GATEWAY_PORT:-8000}}:{gateway_port}"]
    assert services["worker"]["expose"] == ["9100"]
    prom = (files.ROOT / "ops" / "prometheus" / "prometheus.yml").read_text()
    assert f"gateway:{gateway_port}" in prom and "port: 9100" in prom
    for source, container in files.k8s_containers():
        ports = {p["containerPort"] for p in container.get("ports", [])}
        expected = {"ferry-gateway": {8000}, "ferry-worker": {9100}, "ferry-redis": {6379},
                    "ferry-batcher": set(), "ferry-worker-tp": {9100}}
        assert ports == expected[source.split(":")[1]], source


def test_prefix_is_the_default_everywhere() -> None:
    """Deployments pin FERRY_PREFIX to the prefix the ACL file and KEDA patterns assume."""
    prefix = GatewaySettings().prefix
    assert files.compose()["services"]["gateway"]["environment"]["FERRY_PREFIX"] == (
        "${FERRY_PREFIX:-" + prefix + "}"
    )
    for source, container in files.k8s_containers():
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "FERRY_PREFIX" in env:
            assert env["FERRY_PREFIX"] == prefix, source
    acl = (files.ROOT / "ops" / "redis" / "users.acl").read_text()
    assert f"~{Keys(prefix).requests} " in acl and f"&{Keys(prefix).control}" in acl


def test_worker_metrics_are_opened_on_purpose() -> None:
    """Workers' metrics listen on 127.0.0.1 unless told otherwise; every deployment whose
    Prometheus scrapes from another container or pod says 0.0.0.0 itself."""
    import inspect

    from ferry.commands.worker import worker
    from worker.service.redis.connection import WorkerSettings

    assert inspect.signature(worker).parameters["metrics_host"].default == "127.0.0.1"
    assert WorkerSettings().metrics_host == "127.0.0.1"
    workers = [line for line in COMMANDS if line.argv[1] == "worker"]
    assert workers
    for line in workers:
        assert files.setting(line, "--metrics-host") == "0.0.0.0", line


def test_ferry_up_passes_its_metrics_host_to_workers() -> None:
    from ferry.commands.up_children import WorkerSlot

    slot = WorkerSlot("up-1", 0, ("ferry", "worker"), 9100, None, "10.0.0.5")  # type: ignore[arg-type]
    argv = slot.command(0)
    assert _flag(argv, "--metrics-host") == "10.0.0.5"
    default = WorkerSlot("up-1", 0, ("ferry", "worker"), 9100, None)  # type: ignore[arg-type]
    assert _flag(default.command(1), "--metrics-host") == "127.0.0.1"
