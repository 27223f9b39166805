"""Dockerfiles, the gateway's dependency list, .dockerignore and the Kubernetes manifests.

No image is built here (no Docker engine in CI); instead the gateway image's promise — it
runs without torch — is checked by importing its modules with torch blocked, and its
requirements file is checked against every third-party import of those modules.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops import deploy_files as files

GATEWAY_IMAGE_MODULES = ["gateway.app", "gateway.main", "ferry.cli", "observability.logging",
                         "ferry.commands.top", "protocol.client", "protocol.aclient"]
# Import name -> distribution, where they differ; fastapi brings starlette and anyio.
DISTRIBUTION = {"prometheus_client": "prometheus-client", "starlette": "fastapi",
                "anyio": "fastapi"}
FIRST_PARTY = {"protocol", "gateway", "worker", "kernels", "observability", "ferry"}


def _requirement_names(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()  # type: ignore[union-attr]
            out[name] = re.sub(r"^[A-Za-z0-9_.-]+(\[[^\]]*\])?", "", line)
    return out


def _gateway_requirements() -> dict[str, str]:
    text = (files.DOCKER / "gateway-requirements.txt").read_text()
    return _requirement_names(text.splitlines())


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_gateway_image_runs_without_torch() -> None:
    code = ("import sys\nfor m in ('torch', 'transformers', 'triton', 'numpy'):\n"
            "    sys.modules[m] = None\n"
            f"for m in {GATEWAY_IMAGE_MODULES!r}:\n    __import__(m)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=files.ROOT, timeout=120)


def test_gateway_requirements_cover_its_imports_and_match_pyproject() -> None:
    reqs = _gateway_requirements()
    sources = [p for top in ("protocol", "gateway") for p in (files.ROOT / top).rglob("*.py")]
    sources += [files.ROOT / "ferry" / n for n in ("cli.py", "__init__.py")]
    sources += list((files.ROOT / "observability").glob("*.py"))
    sources += list((files.ROOT / "ferry" / "commands").glob("top.py"))
    third_party = set()
    for path in sources:
        third_party |= {m for m in _imports(path)
                        if m not in sys.stdlib_module_names and m not in FIRST_PARTY}
    needed = {DISTRIBUTION.get(m, m).replace("_", "-").lower() for m in third_party}
    assert needed <= set(reqs), f"missing from gateway-requirements.txt: {needed - set(reqs)}"
    assert not {"torch", "transformers", "triton", "numpy"} & set(reqs)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((files.ROOT / "pyproject.toml").read_text())["project"]
    pinned = _requirement_names(project["dependencies"])
    for name, spec in reqs.items():
        assert pinned.get(name) == spec, f"{name}{spec} differs from pyproject: {pinned.get(name)}"


def _stages(text: str) -> list[str]:
    return re.findall(r"^FROM (\S+)", text, re.MULTILINE)


def test_worker_dockerfile() -> None:
    text = files.dockerfiles()["worker.Dockerfile"]
    assert len(_stages(text)) >= 2, "multi-stage"
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:12\.\S+-runtime-", text, re.MULTILINE)
    assert "torch" in text and "triton" in text
    assert "COPY --from=build /opt/venv /opt/venv" in text
    assert re.search(r"^USER ferry$", text, re.MULTILINE)


def test_gateway_dockerfile_is_slim_and_torch_free() -> None:
    text = files.dockerfiles()["gateway.Dockerfile"]
    assert len(_stages(text)) >= 2
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert "pip install --no-deps ." in text and "gateway-requirements.txt" in text
    assert not re.search(r"pip install[^\n]*torch", text)


def test_dockerfiles_copy_only_what_exists_and_is_not_ignored() -> None:
    ignored = [line.strip().lstrip("/") for line in (files.ROOT / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")]
    for name, text in files.dockerfiles().items():
        for match in re.finditer(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
            for src in match.group(1).split():
                assert (files.ROOT / src).exists(), f"{name}: COPY {src} does not exist"
                assert src not in ignored, f"{name}: COPY {src} is excluded by .dockerignore"
    for secretish in (".git", ".venv", "tests", ".env", "models"):
        assert secretish in ignored


def test_dockerfiles_copy_every_package_pyproject_installs() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    find = tomllib.loads((files.ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in find["packages"]["find"]["include"]}
    for name, text in files.dockerfiles().items():
        copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.MULTILINE))
        assert packages <= copied, f"{name} lacks COPY of {sorted(packages - copied)}"


def _by_kind() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in files.k8s_docs()}


def test_k8s_worker_deployment() -> None:
    spec = _by_kind()[("Deployment", "ferry-worker")]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = container["args"]
    drain = int(args[args.index("--drain-timeout-s") + 1])
    assert spec["terminationGracePeriodSeconds"] > drain >= 600  # the gateway's request timeout
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/models", "/cache"} <= mounts


def test_k8s_gateway_deployment_and_service() -> None:
    docs = _by_kind()
    container = docs[("Deployment", "ferry-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = docs[("Service", "ferry-gateway")]["spec"]["ports"]
    assert ports == [{"name": "http", "port": 8000, "targetPort": "http"}]


def test_k8s_secrets_referenced_exist_in_the_example() -> None:
    docs = _by_kind()
    keys = {(name, key) for (kind, name), d in docs.items() if kind == "Secret"
            for key in d["stringData"]}
    refs = set()
    for _, container in files.k8s_containers():
        for item in container.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((ref["name"], ref["key"]))
    for (kind, _), d in docs.items():
        if kind == "TriggerAuthentication":
            refs |= {(r["name"], r["key"]) for r in d["spec"]["secretTargetRef"]}
    assert refs and refs <= keys, refs - keys
    kustomize = yaml.safe_load((files.K8S / "kustomization.yaml").read_text())
    listed = set(kustomize["resources"])
    assert "secrets.example.yaml" not in listed  # placeholders must never be applied
    # worker-tp.yaml is an alternative worker (several GPUs each), applied on its own
    assert listed == {p.name for p in files.K8S.glob("*.yaml")} - {
        "secrets.example.yaml", "kustomization.yaml", "worker-tp.yaml"}
