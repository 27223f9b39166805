"""The wheel users install runs the main job, from outside the checkout.

Every other test imports Ferry from the editable checkout, which hides anything the
package reads at run time but leaves out of its package data (the C++ kernel source was
once missing, and a CPU worker crash-looped on ``FileNotFoundError``). Here the project is
built into a wheel from a copy of its files, installed non-editable into a fresh
virtualenv (torch 2.13.0 first, the CPU build), and ``ferry up --demo`` runs from a
temporary directory with no path leading back to the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.ops import deploy_files as files
from tests.redis_server import free_port

TORCH_SPEC = os.environ.get("FERRY_TEST_TORCH_SPEC", "torch==2.13.0")


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}\n" \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _source_copy(dest: Path) -> Path:
    """The checkout's tracked and not-ignored files, as a clean tree to build from (a
    stale ``build/`` in the checkout cannot leak into the wheel)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=files.ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = files.ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the built wheel installed; returns its bin directory."""
    if shutil.which("git") is None or not (files.ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy the sources from")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(dist), str(src)], cwd=tmp, timeout=300)
    (wheel,) = dist.glob("ferry-*.whl")
    venv.create(tmp / "venv", with_pip=True)
    pip = [str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    # a PYTHONPATH naming the checkout would show pip its ferry.egg-info: "already
    # installed", and the wheel would never be
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([*pip, TORCH_SPEC], cwd=tmp, timeout=600, env=clean)
    _run([*pip, str(wheel)], cwd=tmp, timeout=900, env=clean)
    shutil.rmtree(src)  # nothing can come from the sources any more
    return tmp / "venv" / "bin"


def _outside_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "FERRY_", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp), FERRY_KERNEL_CACHE=str(tmp / "kernels"),
               TRITON_INTERPRET="0", HF_HUB_OFFLINE="1")
    return env


def test_installed_package_has_its_runtime_files(installed: Path, tmp_path: Path) -> None:
    code = ("import kernels.native_build as nb, worker.models as m, worker, sys\n"
            "print(worker.__file__)\n"
            "assert (nb.CSRC / 'paged_decode_cpu.cpp').is_file(), nb.CSRC\n"
            "assert (m.DEFAULT_MODEL_DIR / 'model.safetensors').is_file()\n")
    out = _run([str(installed / "python"), "-c", code], cwd=tmp_path, timeout=120,
               env=_outside_env(tmp_path)).stdout
    assert str(installed.parent) in out and str(files.ROOT) not in out


def test_ferry_up_demo_runs_from_the_wheel_outside_the_checkout(
        installed: Path, tmp_path: Path) -> None:
    env = _outside_env(tmp_path)
    proc = _run([str(installed / "ferry"), "up", "--demo", "--port", str(free_port()),
                 "--demo-max-tokens", "8", "--ready-timeout-s", "300"],
                cwd=tmp_path, timeout=600, env=env)
    for prompt in ("def fibonacci(n):", "class Queue:"):
        assert f">>> {prompt}" in proc.stdout
    # The CPU worker built the C++ decode kernel from the wheel's own source.
    assert list((tmp_path / "kernels").glob("paged_decode_cpu-*.so")), proc.stderr[-2000:]
