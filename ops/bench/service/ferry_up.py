"""``ferry up`` as the service benchmarks start it: the real stack (Redis, gateway,
workers on this CPU), in its own process group, with its output in a log file, ready when
``/readyz`` counts the workers asked for; and stopped as an operator would (SIGINT, then
SIGKILL after a grace period)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from ferry.local_stack import free_port

ROOT = Path(__file__).resolve().parents[3]


def start_ferry(env: Mapping[str, str], log: Path, workers: int = 1,
                args: Sequence[str] = (), ready_s: float = 600.0
                ) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``ferry up --workers N`` with ``env`` on a free port; return it and its base
    URL once ``/readyz`` reports ``workers`` live workers (``RuntimeError`` if it exits
    or is not ready in ``ready_s``; its log is ``log``)."""
    port = free_port()
    with log.open("wb") as sink:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "up", "--port", str(port),
                                 "--workers", str(workers), "--metrics-port", "0", *args],
                                stdout=sink, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ferry up exited ({proc.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            ready = httpx.get(base + "/readyz", timeout=2)
            if ready.status_code == 200 and int(ready.json().get("workers", 0)) >= workers:
                return proc, base
        time.sleep(0.3)
    stop_ferry(proc)
    raise RuntimeError(f"ferry up did not become ready in {ready_s:.0f} s; see {log}")


def stop_ferry(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the stack's process group; SIGKILL if it has not stopped in 90 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def ferry_up(env: Mapping[str, str], log: Path, workers: int = 1,
             args: Sequence[str] = ()) -> Iterator[str]:
    """The stack for a ``with`` block: yields its base URL, stops it on the way out."""
    proc, base = start_ferry(env, log, workers, args)
    try:
        yield base
    finally:
        stop_ferry(proc)
