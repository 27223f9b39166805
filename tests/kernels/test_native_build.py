"""A CPU kernel that cannot be built is a fallback to the torch path, never a dead worker.

Each case runs in a fresh interpreter, because the built kernel is cached per process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GENERATE = """
from worker import LLM, SamplingParams
llm = LLM(max_num_seqs=2, kv_cache_blocks=64, device="cpu")  # the CPU kernel, on any machine
print("BACKEND", type(llm.engine.runner.backend).__name__)
out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4))
print("TEXT", repr(out[0].text))
"""


def _python(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os
    environ = dict(os.environ, FERRY_KERNEL_CACHE=str(tmp / "cache"), **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)


def test_missing_source_or_compiler_or_cache_is_a_build_error(tmp_path: Path) -> None:
    code = """
import kernels.native_build as nb
from pathlib import Path
def reason(**patch):
    old = {k: getattr(nb, k) for k in patch}
    for k, v in patch.items(): setattr(nb, k, v)
    try:
        nb.load("paged_decode_cpu.cpp")
    except nb.NativeBuildError as exc:
        return str(exc)
    finally:
        for k, v in old.items(): setattr(nb, k, v)
    return None
print("SOURCE", reason(CSRC=Path("/nonexistent/csrc")))
print("CACHE", reason(cache_dir=lambda: Path("/proc/ferry-cannot-write-here")))
"""
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert "paged_decode_cpu.cpp" in lines["SOURCE"] and "No such file" in lines["SOURCE"]
    assert lines["CACHE"] != "None"
    proc = _python("import kernels.native_build as nb; nb.load('paged_decode_cpu.cpp')",
                   tmp_path, CXX="/nonexistent/g++")
    assert "NativeBuildError" in proc.stderr and "no C++ compiler" in proc.stderr


def test_engine_falls_back_to_torch_attention_when_the_kernel_cannot_build(
        tmp_path: Path) -> None:
    built = _python(GENERATE, tmp_path)
    fallback = _python(GENERATE.replace(
        "from worker import", "import kernels.native_build as nb; "
        "from pathlib import Path; nb.CSRC = Path('/nonexistent'); from worker import"),
        tmp_path / "other")
    assert built.returncode == 0 and fallback.returncode == 0, built.stderr + fallback.stderr
    assert "BACKEND CpuAttentionBackend" in built.stdout
    assert "BACKEND TorchAttentionBackend" in fallback.stdout
    assert "cpu_attention_fallback" in fallback.stdout + fallback.stderr  # error level
    text = [line for line in built.stdout.splitlines() if line.startswith("TEXT")]
    assert text == [line for line in fallback.stdout.splitlines() if line.startswith("TEXT")]
