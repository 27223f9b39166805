"""Processes of one gateway-bench row: redis-server, ``ferry gateway``, publisher, clients.

The gateway runs as the real CLI (``python -m ferry.cli gateway``) from a given source
tree; ``blocked`` C libraries are hidden from it by a ``sitecustomize`` that makes their
import fail, so redis-py, uvicorn and our code fall back to their pure-Python paths.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ops.bench.service.event_publisher import PublishPlan, publish
from ops.bench.service.sse_clients import run_clients

C_LIBS = ("hiredis", "uvloop", "httptools", "orjson")
_BLOCKER = "import os, sys\nfor _m in os.environ.get('BENCH_BLOCK_MODULES', '').split(','):\n" \
           "    if _m:\n        sys.modules[_m] = None  # import fails: pure-Python path\n"


@dataclass(frozen=True)
class GatewayConfig:
    label: str
    src: Path
    blocked: tuple[str, ...] = field(default=())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not listening on {port}")


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    binary = shutil.which("redis-server") or "redis-server"
    (tmp / "redis.log").unlink(missing_ok=True)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp), "--logfile",
                             str(tmp / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, proc, "redis-server")
    return proc, f"redis://127.0.0.1:{port}/0"


def start_gateway(cfg: GatewayConfig, url: str, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port, site = free_port(), tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = dict(os.environ, FERRY_MAX_QUEUE_LAG="none", BENCH_BLOCK_MODULES=",".join(cfg.blocked),
               PYTHONPATH=os.pathsep.join([str(site), str(cfg.src)]))
    log = open(tmp / "gateway.log", "ab")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "gateway", "--redis-url", url,
                             "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"],
                            cwd=cfg.src, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait_port(port, proc, "ferry gateway")
    return proc, port


def _sample_cpu(pid: int, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out.append((time.time(), times.user + times.system))
        stop.wait(0.1)


def cpu_between(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds per wall second between two instants, from (time, cpu) samples."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return 0.0
    (a, ca), (b, cb) = inside[0], inside[-1]
    return (cb - ca) / max(b - a, 1e-9)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_row(cfg: GatewayConfig, streams: int, rate: float, warmup_s: float, measure_s: float,
            n_clients: int, chat: bool, tmp: Path, profile: str | None = None,
            max_steps: int | None = None) -> dict[str, Any]:
    """One measurement: fresh Redis and gateway, publisher + client processes."""
    ctx = mp.get_context("spawn")
    redis_proc, url = start_redis(tmp)
    gateway, port = start_gateway(cfg, url, tmp)
    spy = None
    procs: list[Any] = []
    try:
        plan = PublishPlan(url, streams, rate, warmup_s, measure_s, max_steps)
        ready, go, results, pub_out = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
        publisher = ctx.Process(target=_publisher, args=(plan, ready, go, pub_out))
        publisher.start()
        procs.append(publisher)
        rids = [f"ev-{i}" for i in range(streams)]
        opened = [ctx.Event() for _ in range(n_clients)]
        for k in range(n_clients):
            p = ctx.Process(target=run_clients, args=("127.0.0.1", port, rids[k::n_clients],
                                                       chat, opened[k], results))
            p.start()
            procs.append(p)
        for event in [*opened, ready]:
            while not event.wait(0.5):
                if gateway.poll() is not None or not all(p.is_alive() for p in procs):
                    raise RuntimeError("a bench process died while opening the streams")
        samples: list[tuple[float, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_cpu, args=(gateway.pid, stop, samples))
        sampler.start()
        if profile:
            Path(profile).mkdir(parents=True, exist_ok=True)
            name = "".join(c if c.isalnum() else "-" for c in f"{cfg.label}-{rate:.0f}")
            spy = subprocess.Popen([_py_spy(), "record", "--pid", str(gateway.pid), "--format",
                                    "raw", "-o", str(Path(profile) / f"{name}.txt"),
                                    "--duration", str(int(warmup_s + measure_s)), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        go.set()
        clients = [results.get(timeout=600) for _ in range(n_clients)]
        pub = pub_out.get(timeout=60)
        stop.set()
        sampler.join()
        for c in clients:
            if "error" in c:
                raise RuntimeError(f"client process failed: {c['error']}")
        log = (tmp / "redis.log").read_text(errors="replace")
        return {"publisher": pub, "clients": clients, "gateway_cpu": samples,
                "pubsub_overflows": log.count("output buffer limits")}
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
        if spy is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
        _stop(gateway)
        _stop(redis_proc)


def _py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def _publisher(plan: PublishPlan, ready: Any, go: Any, out: Any) -> None:
    out.put(publish(plan, ready, go))
