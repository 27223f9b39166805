"""Readers for the deployment files, shared by the tests that hold them against the code.

Every command line in docker-compose.yml, ops/k8s/*.yaml and the Dockerfiles is collected
as an argv, so one test can check them all against the real typer app.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "ops" / "k8s"
DOCKER = ROOT / "ops" / "docker"
DOCS = ROOT / "docs" / "operations.md"
SOURCE_DIRS = ("protocol", "gateway", "worker", "kernels", "observability", "ferry", "ops")
# Names that appear in docstrings as placeholders, not variables anyone reads.
PLACEHOLDER_ENV = frozenset({"FERRY_X"})
FERRY_VAR = re.compile(r"\bFERRY_[A-Z0-9_]*[A-Z0-9]")


@dataclass(frozen=True)
class CommandLine:
    """One ``ferry ...`` invocation found in a deployment file."""

    source: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.source}: {' '.join(self.argv)}"


def setting(line: CommandLine, flag: str) -> str | None:
    """A flag's value on the command line, else (compose configures by variables) the
    service's ``FERRY_<FLAG>`` variable."""
    if flag in line.argv:
        return line.argv[line.argv.index(flag) + 1]
    if line.source.startswith("docker-compose.yml:"):
        env = compose()["services"][line.source.split(":", 1)[1]]["environment"]
        value = env.get("FERRY_" + flag.lstrip("-").replace("-", "_").upper())
        return None if value is None else str(value)
    return None


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # type: ignore[no-any-return]


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document under ops/k8s."""
    out: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"):
        out.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


def k8s_containers() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for name, doc in k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        out.extend((f"{name}:{doc['metadata']['name']}", c) for c in spec.get("containers", []))
    return out


def dockerfiles() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(DOCKER.glob("*.Dockerfile"))}


def command_lines() -> list[CommandLine]:
    """Every ``ferry`` argv in compose services, k8s containers and Dockerfile CMDs."""
    found: list[CommandLine] = []
    for name, service in compose()["services"].items():
        cmd = service.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "ferry":
            found.append(CommandLine(f"docker-compose.yml:{name}", tuple(map(str, cmd))))
    for source, container in k8s_containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv and argv[0] == "ferry":
            found.append(CommandLine(source, tuple(map(str, argv))))
    for name, text in dockerfiles().items():
        for match in re.finditer(r"^CMD (\[.*\])$", text, re.MULTILINE):
            found.append(CommandLine(name, tuple(json.loads(match.group(1)))))
    return found


def env_set_by_deployments() -> dict[str, set[str]]:
    """FERRY_* variable -> the places that set it (compose, k8s, Dockerfile ENV)."""
    where: dict[str, set[str]] = {}
    for name, service in compose()["services"].items():
        for var in service.get("environment") or {}:
            where.setdefault(var, set()).add(f"docker-compose.yml:{name}")
    for source, container in k8s_containers():
        for item in container.get("env", []):
            where.setdefault(item["name"], set()).add(source)
    for name, text in dockerfiles().items():
        for line in re.findall(r"^ENV (.*(?:\\\n.*)*)", text, re.MULTILINE):
            for var in re.findall(r"([A-Z_][A-Z0-9_]*)=", line):
                where.setdefault(var, set()).add(name)
    return {k: v for k, v in where.items() if k.startswith("FERRY_")}


def env_read_by_code() -> set[str]:
    """FERRY_* names in the Python sources, plus the gateway's generated FERRY_<FIELD>."""
    from gateway.settings import GatewaySettings

    names: set[str] = set()
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            names.update(FERRY_VAR.findall(path.read_text(errors="replace")))
    names.update(f"FERRY_{field.upper()}" for field in GatewaySettings.model_fields)
    return names - PLACEHOLDER_ENV


def compose_interpolations() -> set[str]:
    """``${VAR}`` / ``${VAR:-default}`` names substituted by compose itself."""
    return set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", COMPOSE.read_text()))
