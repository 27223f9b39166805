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
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
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
from ferry.commands.up_children import (
    WorkerSlot,
    metrics_ports,
    start_batchers,
    start_gateway,
    start_redis_or_cluster,
    start_workers,
)
from ferry.demo import stream_demo
from ferry.recovery import Recovery
from ferry.supervisor import Fatal, Supervisor
from protocol.cluster.keys import keys_for
from protocol.cluster.shard_slots import DEFAULT_SHARDS


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM to unwind into the cleanup."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


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


@dataclass(frozen=True)
class _Stack:
    """What ``ferry up`` starts, as its options gave it."""

    workers: int
    gateways: int
    model: str | None
    host: str
    port: int
    redis_url: str | None  # None: start Redis here
    metrics_port: int | None
    metrics_host: str
    redis_shards: int  # 0: one redis-server, else a local cluster of this many masters
    redis_replicas: int
    cluster: bool
    shards: int  # request-stream shards on a cluster
    batchers: int
    named: tuple[str, ...]  # --served-model-name, for the gateway and every worker
    lora_roots: tuple[str, ...]
    worker_args: tuple[str, ...]
    demo: bool
    demo_max_tokens: int
    ready_timeout_s: float


def _model_args(quantization: str | None, tensor_parallel_size: int | None) -> list[str]:
    """How every worker loads the model: quantized at load, sharded over ranks."""
    args = ["--quantization", quantization] if quantization else []
    if tensor_parallel_size:  # every worker owns this many ranks (devices on CUDA)
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return args


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
    named = ("--served-model-name", served_model_name) if served_model_name else ()
    shards = stream_shards or redis_shards or DEFAULT_SHARDS
    stack = _Stack(
        workers=workers, gateways=gateways, model=model, host=host, port=port,
        redis_url=redis_url, metrics_port=metrics_port, metrics_host=metrics_host,
        redis_shards=redis_shards, redis_replicas=redis_replicas,
        cluster=redis_cluster or redis_shards > 0, shards=shards, batchers=batchers,
        named=named, lora_roots=tuple(lora_root or ()),
        worker_args=(*named, *lora_args(lora, enable_lora, max_loras, max_lora_rank, lora_root),
                     *_model_args(quantization, tensor_parallel_size)),
        demo=demo, demo_max_tokens=demo_max_tokens, ready_timeout_s=ready_timeout_s)
    raise typer.Exit(_run(stack))


def _run(stack: _Stack) -> int:
    """Start the stack and supervise it until a signal, a fatal exit or the demo's end;
    stop it in order; returns the exit code."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-up-"))
    sup = Supervisor(report=lambda line: typer.secho(f"ferry up: {line}", fg="yellow", err=True))
    if stack.demo:  # keep the terminal for the demo's output; logs go to files
        sup.log_dir = tmp / "logs"
        sup.log_dir.mkdir()
    code, grace, recovery = 0, 1.0, None
    redis_args = ["--redis-cluster", "--stream-shards", str(stack.shards)] \
        if stack.cluster else []
    try:
        url = stack.redis_url or start_redis_or_cluster(sup, tmp, stack.redis_shards,
                                                        stack.redis_replicas)
        recovery = Recovery(url, keys_for(os.environ.get("FERRY_PREFIX", "ferry"),
                                          stack.cluster, stack.shards), f"up-{os.getpid()}")
        host = "127.0.0.1" if stack.host == "0.0.0.0" else stack.host
        gateway_url = f"http://{host}:{stack.port}"
        start_gateway(sup, recovery, [
            "--redis-url", url, "--host", stack.host, "--port", str(stack.port),
            "--workers", str(stack.gateways), *redis_args, *stack.named],
            gateway_lora_env(list(stack.lora_roots)))
        slots = start_workers(sup, recovery, url, stack.model,
                              metrics_ports(stack.metrics_port, stack.workers), redis_args,
                              stack.metrics_host, list(stack.worker_args))
        start_batchers(sup, recovery, url, stack.batchers, redis_args)
        _wait_ready(sup, gateway_url, stack.workers, stack.ready_timeout_s)
        sup.supervising = True
        _print_banner(sup, gateway_url, url, slots, stack.gateways)
        if stack.demo:
            stream_demo(gateway_url, stack.demo_max_tokens)
            return 0
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
    return code
