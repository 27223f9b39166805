"""``ferry up``: Redis + gateway + N workers on this machine, as real processes.

Each part runs the very command an operator (or ``docker-compose.yml``) runs — ``ferry
gateway``, ``ferry worker`` — as its own subprocess, so what works here works deployed.
Children get their own session (a terminal's Ctrl-C reaches only this launcher, which
then stops them in order: workers drain first, then the gateway, then Redis) and, on
Linux, die with the launcher even if it is killed -9 (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import IO, Annotated, Any

import typer

DEMO_PROMPTS = ["def fibonacci(n):", "The quick brown fox", "class Queue:"]


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM to unwind into the cleanup."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stack:
    """The processes of one ``ferry up``; ``stop()`` ends them all, in order."""

    def __init__(self, log_dir: Path | None) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="ferry-up-"))

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        out: Any = None
        if self.log_dir is not None:
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
            start_new_session=True, preexec_fn=_die_with_parent,
        )

    def start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise typer.BadParameter("redis-server not found on PATH; pass --redis-url")
        port, data = _free_port(), self.tmp / "redis"
        data.mkdir()
        self.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(data), "--appendonly", "yes", "--save", "",
                             "--daemonize", "no"])
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                return url
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self.procs["redis"].poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def print_logs(self, lines: int = 30) -> None:
        """On failure, show the end of each child's log before the temp dir goes away."""
        for path in sorted(self.log_dir.glob("*.log")) if self.log_dir else []:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            typer.echo(f"--- {path.name}\n" + "\n".join(tail), err=True)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def stop(self, drain_s: float = 60.0) -> None:
        workers = [n for n in self.procs if n.startswith("worker")]
        for group, grace in ((workers, drain_s), (["gateway"], 15.0), (["redis"], 15.0)):
            procs = [self.procs[n] for n in group if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self._logs:
            log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _readyz(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
            return dict(json.load(resp))
    except urllib.error.HTTPError as exc:
        return dict(json.load(exc))
    except (OSError, ValueError):
        return {"ready": False}


def _wait_ready(stack: Stack, url: str, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stack.check_alive()
        state = _readyz(url)
        if state.get("ready") and int(state.get("workers", 0)) >= workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s: {state}")
        time.sleep(0.25)


def _demo(url: str, max_tokens: int) -> None:
    """Stream a few prompts through the gateway's OpenAI API, printing tokens as they come."""
    for prompt in DEMO_PROMPTS:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
        req = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        sys.stdout.write(f"\n>>> {prompt}")
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"demo request failed: {chunk['error']}")
                sys.stdout.write(chunk["choices"][0].get("text", ""))
                sys.stdout.flush()
        sys.stdout.write("\n")


def up(
    workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 1,
    model: Annotated[str | None, typer.Option(envvar="FERRY_MODEL")] = None,
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
    host: Annotated[str, typer.Option(help="Gateway bind address.")] = "127.0.0.1",
    redis_url: Annotated[str | None, typer.Option(
        help="Use this Redis instead of starting one.")] = None,
    demo: Annotated[bool, typer.Option(help="Stream a few prompts, then stop.")] = False,
    demo_max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    ready_timeout_s: Annotated[float, typer.Option()] = 600.0,
) -> None:
    """Start Redis (unless --redis-url), the gateway and N workers; stop all on Ctrl-C."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    stack = Stack(None)
    if demo:  # keep the terminal for the demo's output; logs go to files
        stack.log_dir = stack.tmp / "logs"
        stack.log_dir.mkdir()
    ferry = [sys.executable, "-m", "ferry.cli"]
    code = 0
    try:
        url = redis_url or stack.start_redis()
        gateway_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
        stack.spawn("gateway", [*ferry, "gateway", "--redis-url", url, "--host", host,
                                "--port", str(port)])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("FERRY_TORCH_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        for i in range(workers):
            cmd = [*ferry, "worker", "--redis-url", url, "--worker-id", f"up-{os.getpid()}-{i}"]
            stack.spawn(f"worker-{i}", cmd + (["--model", model] if model else []), env)
        _wait_ready(stack, gateway_url, workers, ready_timeout_s)
        typer.echo(f"Ferry is up: {gateway_url} ({workers} worker(s), redis {url})")
        typer.echo(f"  curl -N {gateway_url}/v1/completions -H 'Content-Type: application/json'"
                   ' -d \'{"prompt": "def fibonacci(n):", "max_tokens": 32, "stream": true}\'')
        if demo:
            _demo(gateway_url, demo_max_tokens)
            return
        typer.echo("Ctrl-C stops everything.")
        while True:
            stack.check_alive()
            time.sleep(0.5)
    except _Stop as stop:
        typer.echo(f"\n{stop}: stopping (workers drain first)...")
    except (RuntimeError, OSError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        stack.print_logs()
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        stack.stop()
    raise typer.Exit(code)
