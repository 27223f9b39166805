"""The GPU engine benchmark runs end to end in its CPU smoke form (a tiny model, a few
requests), so a device session never finds it broken; speed is not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "engine-cpu.json"
    cmd = [sys.executable, "ops/bench/engine/engine.py", "--device", "cpu", "--model-size", "tiny",
           "--scale", "0.02", "--skip", "hf", "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["tiny/mixed-gpu"]
    [ferry] = result["rows"]
    assert ferry["system"] == "ferry" and ferry["complete"] and ferry["requests"] == 5
    step = result["decode_step"]
    assert step["batch"] == 5 and step["wall_ms"] > 0


def test_hf_continuous_config_uses_the_installed_page_size_field() -> None:
    import dataclasses

    from transformers import ContinuousBatchingConfig

    from ops.bench.engine.engine_gpu import hf_continuous_config

    cfg = hf_continuous_config(page=128, max_batch_tokens=1024, not_a_field=1)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    assert getattr(cfg, page_field) == 128 and cfg.max_batch_tokens == 1024
