"""List and count the product files one decode step crosses, engine and service.

Runs the default model (CPU) in a real ``WorkerService`` against a real redis-server, on
the service's default path (an output process), with a few requests decoding; once they
decode steadily, ``sys.setprofile`` on the engine loop's thread records every Python
function called during ``--steps`` whole loop iterations. A product file is a ``.py``
file of this repository outside ``tests/`` and ``.venv/``. Two sets are printed: the
files ``Engine.step`` crosses, and those of the loop's whole iteration (mailbox, job
table, ``Engine.step``, events, outbox hand-off, metrics), which is the count
``docs/structures.md`` quotes. The output process's own work (detokenizing, writing to
Redis) runs in another process and is not in the count.

    .venv/bin/python ops/trace_step.py [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


_SELF = Path(__file__).resolve().relative_to(ROOT)  # its wrappers are not the product's


def _product(filename: str) -> str | None:
    """``filename`` relative to the repository when it is a product module, else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.suffix != ".py" or rel.parts[0] in ("tests", ".venv") or rel == _SELF:
        return None
    return rel.as_posix()


class Recorder:
    """The profile hook: files called while ``on``; those inside ``Engine.step`` apart."""

    def __init__(self) -> None:
        self.on = False
        self.in_step = 0
        self.loop: dict[str, set[str]] = {}  # file -> the functions called in it
        self.step: set[str] = set()
        self._cache: dict[str, str | None] = {}

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if not self.on or event != "call":
            return
        name = frame.f_code.co_filename
        rel = self._cache.get(name, "")
        if rel == "":
            rel = self._cache[name] = _product(name)
        if rel is not None:
            self.loop.setdefault(rel, set()).add(frame.f_code.co_name)
            if self.in_step:
                self.step.add(rel)


def trace(steps: int, warm_steps: int, requests: int) -> dict[str, dict[str, list[str]]]:
    import torch

    from ops.bench.cluster.cluster_nodes import start_single
    from protocol.client import FerryClient
    from protocol.models import GenerateRequest
    from protocol.sampling import SamplingParams
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.service.redis.connection import WorkerSettings
    from worker.service.service import WorkerService

    torch.set_num_threads(1)
    rec = Recorder()
    with tempfile.TemporaryDirectory() as tmp, start_single(Path(tmp)) as nodes:
        engine = Engine(EngineConfig.from_env(None, {}, device="cpu"))
        settings = WorkerSettings(redis_url=nodes.url, worker_id=f"trace-{uuid.uuid4().hex[:6]}")
        service = WorkerService(engine, settings)
        counted = {"steps": 0}
        done = threading.Event()
        inner_step, inner_loop_step = engine.step, service._step

        def engine_step() -> Any:
            rec.in_step += 1
            try:
                return inner_step()
            finally:
                rec.in_step -= 1

        def loop_step() -> None:
            inner_loop_step()
            counted["steps"] += 1
            if counted["steps"] == warm_steps:
                rec.on = True  # from the end of one step to the end of the last
            elif counted["steps"] == warm_steps + steps:
                rec.on = False
                done.set()

        engine.step = engine_step  # type: ignore[method-assign]
        service._step = loop_step  # type: ignore[method-assign]
        inner_loop = service._loop

        def traced_loop() -> None:
            sys.setprofile(rec)
            try:
                inner_loop()
            finally:
                sys.setprofile(None)

        service._loop = traced_loop  # type: ignore[method-assign]
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        client = FerryClient.from_url(nodes.url)
        params = SamplingParams(max_tokens=warm_steps + steps + 64, ignore_eos=True)
        for i in range(requests):
            client.enqueue(GenerateRequest(prompt=f"def f{i}(x):", params=params))
        if not done.wait(600):
            raise SystemExit("the decode steps did not come")
        service.request_stop(force=True)
        thread.join(30)
        client.close()
    loop = {path: sorted(names) for path, names in sorted(rec.loop.items())}
    return {"engine_step": {path: loop[path] for path in sorted(rec.step)},
            "loop_iteration": loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="decode steps recorded")
    parser.add_argument("--warm-steps", type=int, default=12, help="steps before recording")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the lists here")
    parser.add_argument("--functions", action="store_true",
                        help="also name the functions called in each file")
    args = parser.parse_args()
    start = time.perf_counter()
    files = trace(args.steps, args.warm_steps, args.requests)
    for name, listed in files.items():
        print(f"{name}: {len(listed)} product files")
        for path, names in listed.items():
            print(f"  {path}" + (f"  ({', '.join(names)})" if args.functions else ""))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(files, indent=1) + "\n")


if __name__ == "__main__":
    main()
