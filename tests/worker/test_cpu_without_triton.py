"""A CPU worker runs without triton installed: the CPU image leaves it out (~1 GB).

Each check runs in a fresh interpreter with ``triton`` blocked in ``sys.modules``, which
makes every ``import triton`` fail exactly as in an environment that lacks the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = "import sys\nsys.modules['triton'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_engine_generates_without_triton() -> None:
    proc = _run(
        "from worker import LLM, SamplingParams\n"
        "llm = LLM(max_num_seqs=2, kv_cache_blocks=64)\n"
        "print('backend:', type(llm.engine.runner.backend).__name__)\n"
        "out = llm.generate(['def add(a, b):'], SamplingParams(temperature=0, max_tokens=4))\n"
        "assert out[0].finish_reason == 'length', out[0]\n"
        "import kernels, worker.service.main, worker.service.service\n"
        "assert kernels.reference is not None\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the engine's load logs (which decode path it took) may come first on stdout
    backend = proc.stdout.split("backend:", 1)[1].split()[0]
    assert backend in ("CpuAttentionBackend", "TorchAttentionBackend")


def test_asking_for_triton_without_it_is_a_clear_error() -> None:
    proc = _run(
        "import torch\nfrom worker.engine.runner.attention.interface import make_backend\n"
        "try:\n    make_backend('triton', torch.device('cuda'))\n"
        "except ValueError as exc:\n    print('ERROR', exc)\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR attention_backend 'triton' needs the triton package" in proc.stdout
