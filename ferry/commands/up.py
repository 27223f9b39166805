"""``ferry up``: Redis + gateway + N workers on this machine, as real, supervised processes.

Each part runs the very command an operator (or ``docker-compose.yml``) runs — ``ferry
gateway``, ``ferry worker`` — as its own subprocess, so what works here works deployed.
``ferry/supervisor.py`` owns the processes: a worker or gateway that exits is logged and
restarted with backoff (a crash loop is reported and slowed), and the rest keeps serving;
a dead worker's entries are handed back at once (``ferry/recovery.py``) so the survivors or
its replacement resume them. Redis, when started here, is the one fatal exit. Only
SIGINT/SIGTERM stops the stack, in order: workers drain first, then the gateway, then Redis.
Every incarnation of worker ``i`` gets its own consumer name (``up-<pid>-<i>``, then
``...-r<n>``), so which process owns an entry is never ambiguous, and keeps its metrics port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from ferry.commands.lora_flags import (
    EnableLora,
    LoraModules,
    LoraRoots,
    MaxLoraRank,
    MaxLoras,
    gateway_lora_env,
    lora_args,
)
from ferry.demo import stream_demo
from ferry.local_cluster import ClusterLayout
from ferry.local_stack import free_port, start_redis, start_redis_cluster
from ferry.recovery import Recovery
from ferry.supervisor import ChildSpec, Exit, Fatal, Supervisor
from protocol.cluster.keys import keys_for
from protocol.cluster.shard_slots import DEFAULT_SHARDS

FERRY = (sys.executable, "-m", "ferry.cli")


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM to unwind into the cleanup."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


@dataclass(frozen=True)
class WorkerSlot:
    """Worker ``index`` of a launcher, across its incarnations."""

    launcher: str
    index: int
    base_cmd: tuple[str, ...]
    metrics_port: int  # 0: off
    recovery: Recovery
    metrics_host: str = "127.0.0.1"

    def worker_id(self, incarnation: int) -> str:
        suffix = f"-r{incarnation}" if incarnation else ""
        return f"{self.launcher}-{self.index}{suffix}"

    def command(self, incarnation: int) -> list[str]:
        return [*self.base_cmd, "--worker-id", self.worker_id(incarnation),
                "--metrics-port", str(self.metrics_port), "--metrics-host", self.metrics_host]

    def on_exit(self, exit: Exit) -> str | None:
        notes = [self.recovery.worker_died(self.worker_id(exit.incarnation))]
        if exit.restart_in_s is not None:
            notes.append(self.recovery.record_exit(exit, self.worker_id(exit.next_incarnation)))
        return "; ".join(n for n in notes if n) or None


def _readyz(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
            return dict(json.load(resp))
    except urllib.error.HTTPError as exc:
        return dict(json.load(exc))
    except (OSError, ValueError):
        return {"ready": False}


def _wait_ready(sup: Supervisor, url: str, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        sup.poll()  # any exit before the stack is ready raises Fatal
        state = _readyz(url)
        if state.get("ready") and int(state.get("workers", 0)) >= workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s: {state}")
        time.sleep(0.25)


def _metrics_ports(first: int | None, workers: int) -> list[int]:
    """Worker i's Prometheus port: ``first + i``; free ports when unset; 0 turns them off."""
    if first is None:
        return [free_port() for _ in range(workers)]
    return [first + i if first else 0 for i in range(workers)]


def _print_banner(sup: Supervisor, url: str, redis_url: str, slots: list[WorkerSlot],
                  gateways: int) -> None:
    typer.echo(f"Ferry is up: {url} ({len(slots)} worker(s), redis {redis_url})")
    if "redis" in sup.children:
        typer.echo(f"  redis     pid {sup.children['redis'].pid}, {redis_url}")
    nodes = [c for name, c in sup.children.items() if name.startswith("redis-")]
    if nodes:
        typer.echo(f"  redis     cluster of {len(nodes)} nodes, pids "
                   f"{' '.join(str(c.pid) for c in nodes)} (a dead node is restarted)")
    gateway = sup.children["gateway"]
    typer.echo(f"  gateway   pid {gateway.pid}, {gateways} process(es) on {url}")
    for name in sorted(n for n in sup.children if n.startswith("batcher")):
        typer.echo(f"  {name:<9} pid {sup.children[name].pid}, Batch API driver")
    for slot in slots:
        child = sup.children[f"worker-{slot.index}"]
        shown = "127.0.0.1" if slot.metrics_host == "0.0.0.0" else slot.metrics_host
        metrics = (f"metrics http://{shown}:{slot.metrics_port}/metrics"
                   if slot.metrics_port else "metrics off")
        typer.echo(f"  worker-{slot.index}  pid {child.pid}, id {slot.worker_id(0)}, {metrics}")
    keyed = os.environ.get("FERRY_API_KEYS") or os.environ.get("FERRY_TENANTS_FILE")
    auth = " -H \"Authorization: Bearer $KEY\"" if keyed else ""  # the key is never printed
    typer.echo(f"  curl -N {url}/v1/completions{auth} -H 'Content-Type: application/json'"
               ' -d \'{"prompt": "def fibonacci(n):", "max_tokens": 32, "stream": true}\'')


def _start_gateway(sup: Supervisor, recovery: Recovery, args: list[str],
                   env: dict[str, str]) -> None:
    def on_exit(exit: Exit) -> str | None:
        return recovery.record_exit(exit, "gateway") if exit.restart_in_s is not None else None

    cmd = [*FERRY, "gateway", *args]
    sup.start(ChildSpec("gateway", lambda _n: cmd, dict(os.environ, **env) if env else None,
                        stop_order=1, on_exit=on_exit))


def _start_workers(sup: Supervisor, recovery: Recovery, url: str, model: str | None,
                   metrics_ports: list[int], redis_args: list[str], metrics_host: str,
                   worker_args: list[str]) -> list[WorkerSlot]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    threads = max(1, (os.cpu_count() or 1) // len(metrics_ports))
    env.setdefault("FERRY_TORCH_THREADS", str(threads))
    base = (*FERRY, "worker", "--redis-url", url, *redis_args,
            *(("--model", model) if model else ()), *worker_args)
    slots = [WorkerSlot(recovery.launcher, i, base, port, recovery, metrics_host)
             for i, port in enumerate(metrics_ports)]
    for slot in slots:  # workers drain for up to 60 s on SIGTERM (their own drain is 30 s)
        sup.start(ChildSpec(f"worker-{slot.index}", slot.command, env, stop_grace_s=60.0,
                            on_exit=slot.on_exit))
    return slots


def _start_redis(sup: Supervisor, tmp: Path, masters: int, replicas: int) -> str:
    """One redis-server, or with ``masters`` a local Redis Cluster; returns its URL."""
    if not masters:
        return start_redis(sup, tmp / "redis")
    try:
        layout = ClusterLayout(masters=masters, replicas=replicas)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--redis-shards") from exc
    return start_redis_cluster(sup, tmp / "redis-cluster", layout)


def _same(cmd: list[str], _incarnation: int) -> list[str]:
    return cmd


def _start_batchers(sup: Supervisor, recovery: Recovery, url: str, count: int,
                    redis_args: list[str]) -> None:
    """Batch API drivers; each restart keeps its id, so a replacement takes its dead
    predecessor's leases at once instead of waiting them out."""
    for i in range(count):
        name = f"batcher-{i}" if count > 1 else "batcher"

        def on_exit(exit: Exit, name: str = name) -> str | None:
            return recovery.record_exit(exit, name) if exit.restart_in_s is not None else None

        cmd = [*FERRY, "batcher", "--redis-url", url, *redis_args, "--batcher-id",
               f"{recovery.launcher}-{name}"]
        sup.start(ChildSpec(name, partial(_same, cmd), stop_grace_s=15.0, on_exit=on_exit))


def _report_fatal(sup: Supervisor, exc: Fatal) -> float:
    """Say why the stack stops; returns the scale of the stop graces."""
    if exc.exit.name == "redis":
        typer.secho(f"error: {exc}. Redis held the queue and every stream; ferry up does not "
                    "restart it under running workers, so the stack stops.", fg="red", err=True)
        _show_logs(sup)
        return 0.1  # nothing can drain into a dead Redis
    typer.secho(f"error: {exc} (before the stack was ready)", fg="red", err=True)
    _show_logs(sup)
    return 1.0


def _show_logs(sup: Supervisor) -> None:
    """On failure, the end of each child's log (only the demo logs to files; otherwise the
    children already wrote to this terminal)."""
    tails = sup.log_tails()
    if tails:
        typer.echo(tails, err=True)


def up(
    workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 1,
    gateways: Annotated[int, typer.Option(
        min=1, help="Gateway processes sharing the port (ferry gateway --workers).")] = 1,
    model: Annotated[str | None, typer.Option(envvar="FERRY_MODEL")] = None,
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
    host: Annotated[str, typer.Option(help="Gateway bind address.")] = "127.0.0.1",
    redis_url: Annotated[str | None, typer.Option(
        help="Use this Redis instead of starting one.")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        min=0, help="Worker i serves Prometheus metrics on this port + i (default: free "
        "ports, printed at start; 0: off).")] = None,
    metrics_host: Annotated[str, typer.Option(
        help="Workers' metrics bind address (0.0.0.0: every interface).")] = "127.0.0.1",
    served_model_name: Annotated[str | None, typer.Option(
        envvar="FERRY_SERVED_MODEL_NAME", help="The model's name in the API (default: the "
        "model directory's name); requests naming another model get 404.")] = None,
    redis_shards: Annotated[int, typer.Option(
        min=0, help="Start a local Redis Cluster of this many masters (at least 3) instead "
        "of one redis-server; 0: one redis-server.")] = 0,
    redis_replicas: Annotated[int, typer.Option(
        min=0, help="Replicas per master of the local cluster.")] = 1,
    redis_cluster: Annotated[bool, typer.Option(
        envvar="FERRY_REDIS_CLUSTER", help="--redis-url names a node of a Redis Cluster.")
    ] = False,
    stream_shards: Annotated[int | None, typer.Option(
        min=1, envvar="FERRY_STREAM_SHARDS", help="Cluster: request-stream shards (default: "
        "--redis-shards, else 3).")] = None,
    batchers: Annotated[int, typer.Option(
        min=0, help="Batch API drivers (ferry batcher); 0: none.")] = 1,
    lora: LoraModules = None,
    enable_lora: EnableLora = False,
    max_loras: MaxLoras = None,
    max_lora_rank: MaxLoraRank = None,
    lora_root: LoraRoots = None,
    quantization: Annotated[str | None, typer.Option(
        envvar="FERRY_QUANTIZATION", help="Workers quantize the weights at load: fp8, int8, "
        "int4 (docs/quantization.md).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(
        min=1, envvar="FERRY_TENSOR_PARALLEL_SIZE", help="Each worker shards the model over "
        "this many ranks (one device each on CUDA; docs/tensor-parallel.md).")] = None,
    demo: Annotated[bool, typer.Option(help="Stream a few prompts, then stop.")] = False,
    demo_max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    ready_timeout_s: Annotated[float, typer.Option()] = 600.0,
) -> None:
    """Start Redis (unless --redis-url), the gateway and N workers; restart what dies;
    stop all on Ctrl-C."""
    named = ["--served-model-name", served_model_name] if served_model_name else []
    worker_args = [*named, *lora_args(lora, enable_lora, max_loras, max_lora_rank, lora_root)]
    if quantization:  # every worker quantizes the checkpoint at load
        worker_args += ["--quantization", quantization]
    if tensor_parallel_size:  # every worker owns this many ranks (devices on CUDA)
        worker_args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-up-"))
    sup = Supervisor(report=lambda line: typer.secho(f"ferry up: {line}", fg="yellow", err=True))
    if demo:  # keep the terminal for the demo's output; logs go to files
        sup.log_dir = tmp / "logs"
        sup.log_dir.mkdir()
    code, grace, recovery = 0, 1.0, None
    cluster = redis_cluster or redis_shards > 0
    shards = stream_shards or redis_shards or DEFAULT_SHARDS
    redis_args = ["--redis-cluster", "--stream-shards", str(shards)] if cluster else []
    try:
        url = redis_url or _start_redis(sup, tmp, redis_shards, redis_replicas)
        recovery = Recovery(url, keys_for(os.environ.get("FERRY_PREFIX", "ferry"), cluster,
                                          shards), f"up-{os.getpid()}")
        gateway_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
        _start_gateway(sup, recovery, [
            "--redis-url", url, "--host", host, "--port", str(port), "--workers", str(gateways),
            *redis_args, *named], gateway_lora_env(lora_root))
        slots = _start_workers(sup, recovery, url, model, _metrics_ports(metrics_port, workers),
                               redis_args, metrics_host, worker_args)
        _start_batchers(sup, recovery, url, batchers, redis_args)
        _wait_ready(sup, gateway_url, workers, ready_timeout_s)
        sup.supervising = True
        _print_banner(sup, gateway_url, url, slots, gateways)
        if demo:
            stream_demo(gateway_url, demo_max_tokens)
            return
        typer.echo("Ctrl-C stops everything.")
        while True:
            sup.poll()
            recovery.tick()
            time.sleep(0.2)
    except _Stop as stop:
        typer.echo(f"\n{stop}: stopping (workers drain first)...")
    except Fatal as exc:
        code, grace = 1, _report_fatal(sup, exc)
    except (RuntimeError, OSError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        _show_logs(sup)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        if recovery is not None:
            recovery.close()
        sup.stop(grace_scale=grace)
        shutil.rmtree(tmp, ignore_errors=True)
    raise typer.Exit(code)
