"""The compose smoke test's own files: README's commands are the ones it runs, and its
override resolves on top of the real compose file (the run itself is ops/test.sh's job).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ops import deploy_files as files

SCRIPT = files.ROOT / "ops" / "compose-smoke.sh"
DRIVER = files.ROOT / "ops" / "compose_smoke.py"
OVERRIDE = files.DOCKER / "compose.smoke.yml"


def _readme_cpu_commands() -> list[str]:
    """Arguments after ``--profile cpu`` of README's no-GPU ``docker compose`` lines."""
    readme = (files.ROOT / "README.md").read_text()
    section = readme[readme.index("No GPU, as `ops/compose-smoke.sh`"):]
    section = section[:section.index("\n\n", section.index("docker compose"))]
    return [line.split("--profile cpu", 1)[1].split("#", 1)[0].strip()
            for line in section.splitlines() if "docker compose --profile cpu" in line]


def _smoke_commands() -> set[str]:
    """Every compose invocation of the script (``compose ...``) and the driver."""
    shell = {m.group(1).split(">")[0].split("||")[0].strip()
             for m in re.finditer(r"^\s*(?:COMPOSE_UP=1\s*)?compose (.+)$",
                                  SCRIPT.read_text(), re.M)}
    python = set()
    for node in ast.walk(ast.parse(DRIVER.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compose":
            python.add(" ".join(a.value for a in node.args if isinstance(a, ast.Constant)))
    return shell | python


def test_readme_deploys_with_the_commands_the_smoke_test_runs() -> None:
    readme = _readme_cpu_commands()
    assert len(readme) >= 4
    missing = [cmd for cmd in readme if cmd not in _smoke_commands()]
    assert not missing, f"README commands the smoke test never runs: {missing}"


def test_script_is_valid_bash_and_says_how_it_ends() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert 'say "passed' in text and "exit 77" in text and "down -v" in text


class _ComposeLoader(yaml.SafeLoader):
    """Compose's ``!reset`` tag (drop the base file's value) loads as an empty list."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: [])


def test_override_keeps_every_port_on_loopback() -> None:
    override = yaml.load(OVERRIDE.read_text(), Loader=_ComposeLoader)["services"]
    for name, service in override.items():
        assert service["network_mode"] == "host", name
        assert service.get("ports", []) == [], name  # nothing published beyond loopback
    env = override["gateway"]["environment"]
    assert env["FERRY_HOST"] == "127.0.0.1" and "SMOKE_" in env["FERRY_PORT"]
    assert "--bind" in override["redis"]["command"]


def test_override_resolves_on_the_real_compose_file(tmp_path: Path) -> None:
    if shutil.which("docker") is None or subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no compose client here")
    env = tmp_path / "smoke.env"
    env.write_text("SMOKE_REDIS_PORT=1\nSMOKE_GATEWAY_PORT=2\nSMOKE_METRICS_PORT=3\n"
                   "SMOKE_WHEELS_URL=http://127.0.0.1:4/\nSMOKE_MODELS_DIR=/tmp\n")
    out = subprocess.run(
        ["docker", "compose", "--env-file", str(env), "-f", str(files.COMPOSE), "-f",
         str(OVERRIDE), "--profile", "cpu", "config"],
        capture_output=True, text=True, cwd=files.ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert services["worker-cpu"]["environment"]["FERRY_REDIS_URL"] == "redis://redis:1/0"
    assert services["worker-cpu"]["build"]["args"]["PIP_NO_INDEX"] == "1"
    assert "ports" not in services["redis"] and "ports" not in services["gateway"]
