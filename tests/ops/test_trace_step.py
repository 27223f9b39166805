"""The decode step's walk stays at most 24 product files (``ops/trace_step.py`` on the
default model in a real worker service, an output process and a redis-server), and the
count ``docs/structures.md`` quotes is the one measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 24  # product files one steady loop iteration may cross


def test_one_loop_iteration_crosses_at_most_24_product_files(tmp_path: Path) -> None:
    out = tmp_path / "walk.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "ops" / "trace_step.py"),
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    walk = json.loads(out.read_text())
    loop, step = walk["loop_iteration"], walk["engine_step"]
    assert set(step) <= set(loop)
    assert len(loop) <= LIMIT, f"{len(loop)} files: {sorted(loop)}"
    quoted = re.search(r"iteration crosses \*\*(\d+)\*\* product files",
                       (ROOT / "docs" / "structures.md").read_text())
    assert quoted is not None and int(quoted.group(1)) == len(loop), (
        f"docs/structures.md quotes {quoted and quoted.group(1)}, measured {len(loop)}")
