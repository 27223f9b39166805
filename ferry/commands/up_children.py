"""The children ``ferry up`` starts under its supervisor: Redis, the gateway, the workers and
the Batch API drivers, each as the very ``ferry`` command an operator runs.

Each child's exit hook records the exit with ``ferry/recovery.py``, which hands a dead
worker's entries back at once; a worker keeps its index and metrics port across
incarnations (``WorkerSlot``), a batcher keeps its id so its replacement takes its leases.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import typer

from ferry.local_cluster import ClusterLayout
from ferry.local_stack import free_port, start_redis, start_redis_cluster
from ferry.recovery import Recovery
from ferry.supervisor import ChildSpec, Exit, Supervisor

FERRY = (sys.executable, "-m", "ferry.cli")


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


def metrics_ports(first: int | None, workers: int) -> list[int]:
    """Worker i's Prometheus port: ``first + i``; free ports when unset; 0 turns them off."""
    if first is None:
        return [free_port() for _ in range(workers)]
    return [first + i if first else 0 for i in range(workers)]


def start_gateway(sup: Supervisor, recovery: Recovery, args: list[str],
                   env: dict[str, str]) -> None:
    def on_exit(exit: Exit) -> str | None:
        return recovery.record_exit(exit, "gateway") if exit.restart_in_s is not None else None

    cmd = [*FERRY, "gateway", *args]
    sup.start(ChildSpec("gateway", lambda _n: cmd, dict(os.environ, **env) if env else None,
                        stop_order=1, on_exit=on_exit))


def start_workers(sup: Supervisor, recovery: Recovery, url: str, model: str | None,
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


def start_redis_or_cluster(sup: Supervisor, tmp: Path, masters: int, replicas: int) -> str:
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


def start_batchers(sup: Supervisor, recovery: Recovery, url: str, count: int,
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
