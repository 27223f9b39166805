"""Test helpers: a real ``ferry gateway`` subprocess, and who listens / answers on a port,
read from ``/proc/net/tcp{,6}`` and ``/proc/<pid>/fd`` (no cooperation from the server)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.worker.service.procs import ROOT, ferry_env

LISTEN, ESTABLISHED = "0A", "01"


def _rows() -> list[tuple[str, int, str, int, str, int]]:
    """(local address hex, local port, remote address hex, remote port, state, inode)."""
    out = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            (laddr, lport), (raddr, rport) = f[1].split(":"), f[2].split(":")
            out.append((laddr, int(lport, 16), raddr, int(rport, 16), f[3], int(f[9])))
    return out


def listen_addresses(port: int) -> set[str]:
    """Hex local addresses listening on ``port``: ``0100007F`` is 127.0.0.1, zeros any."""
    return {laddr for laddr, lport, _r, _rp, state, _i in _rows()
            if lport == port and state == LISTEN}


def socket_owners(inode: int) -> set[int]:
    """Pids holding a file descriptor on the socket ``inode``."""
    target, pids = f"socket:[{inode}]", set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        pids.add(int(proc.name))
                        break
    return pids


def children_of(pid: int) -> set[int]:
    """Pids whose parent is ``pid``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:  # ppid
            found.add(int(stat.parent.name))
    return found


def listening_pids(port: int) -> set[int]:
    """Pids holding a socket listening on ``port``."""
    pids: set[int] = set()
    for _laddr, lport, _raddr, _rport, state, inode in _rows():
        if lport == port and state == LISTEN:
            pids |= socket_owners(inode)
    return pids


def server_of(port: int, client_port: int) -> set[int]:
    """Pids holding the server side of the connection from ``client_port`` to ``port``."""
    for _laddr, lport, _raddr, rport, state, inode in _rows():
        if lport == port and rport == client_port and state == ESTABLISHED and inode:
            return socket_owners(inode)
    return set()


class GatewayProcess:
    """``ferry gateway`` exactly as an operator runs it; its output kept for assertions."""

    def __init__(self, redis_url: str, port: int, *args: str, **env: str) -> None:
        self.port = port
        self.cmd = [sys.executable, "-m", "ferry.cli", "gateway", "--redis-url", redis_url,
                    "--port", str(port), *args]
        self.env = ferry_env(**env)
        self.proc: subprocess.Popen[str] | None = None
        self.output = ""

    def __enter__(self) -> GatewayProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, env=self.env, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> GatewayProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}: {self.stop()}")
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{self.port}/healthz"
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return self
            time.sleep(0.1)
        raise TimeoutError(f"gateway not healthy after {timeout}s: {self.stop()}")

    def stop(self) -> str:
        """SIGTERM, then whatever is left of its process group; returns its output."""
        if self.proc is None:
            return self.output
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.output, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.output, _ = self.proc.communicate()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
        return self.output

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
