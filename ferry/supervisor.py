"""Child processes of ``ferry up``: start them, restart the ones that die (with backoff), stop
them in order.

Why restart instead of ending the stack when one child exits: a worker killed by the OOM
killer or a CUDA error is routine in serving, and everything else (the other workers, the
gateway's open streams, the queue) is fine. The dead worker's requests are resumed by the
survivors or by its replacement through the lease/reaper path, so restarting it is all
that is left to do. What a restart must never do is hide a child that cannot stay up: a
child that exits within ``stable_s`` of starting is a *quick failure*; consecutive quick
failures double the delay before the next start (up to ``max_s``) and, from
``crash_loop_after`` on, every exit is reported as a crash loop. A child that ran
``stable_s`` resets its count.

A child whose spec says ``restart=False`` (Redis) is fatal when it exits: ``poll`` raises
:class:`Fatal`. Before :attr:`Supervisor.supervising` is switched on (the stack is not
ready yet), every exit is fatal: a bad flag or model path should fail fast with its log,
not loop.

Each child leads its own session (process group), so a terminal's Ctrl-C reaches only the
launcher, and when a child exits the supervisor SIGKILLs whatever it left behind in its
group (uvicorn's worker processes of a ``--workers N`` gateway would otherwise keep the
port) *before* reaping it: an unreaped leader keeps its pid, so the group id cannot have
been reused by an unrelated process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff for children that keep dying soon after they start."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 60.0
    stable_s: float = 60.0  # a child that ran this long was not crash-looping
    crash_loop_after: int = 3  # consecutive quick failures from which a loop is reported

    def delay(self, quick_failures: int) -> float:
        """Seconds before the next start, after ``quick_failures`` quick exits in a row."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, quick_failures - 1))


@dataclass(frozen=True)
class Exit:
    """One child incarnation's exit, and what the supervisor decided about it."""

    name: str
    incarnation: int  # 0 for the first start, n for the n-th restart
    pid: int
    code: int  # negative: killed by that signal (subprocess convention)
    ran_s: float
    quick_failures: int
    restart_in_s: float | None  # None: not restarted (fatal, or stopping)
    crash_loop: bool

    @property
    def next_incarnation(self) -> int:
        return self.incarnation + 1

    def describe(self) -> str:
        how = f"code {self.code}"
        if self.code < 0:
            with contextlib.suppress(ValueError):
                how += f" ({signal.Signals(-self.code).name})"
        return f"{self.name} (pid {self.pid}) exited with {how} after {self.ran_s:.1f} s"


ExitHook = Callable[[Exit], "str | None"]
"""Called once per exit (not while stopping); returns a note for the log line, or None."""


@dataclass(frozen=True)
class ChildSpec:
    """How to run one supervised process; ``command(n)`` builds the argv of incarnation n."""

    name: str
    command: Callable[[int], list[str]]
    env: Mapping[str, str] | None = None
    restart: bool = True  # False: its exit ends the stack (Fatal)
    stop_order: int = 0  # lower stops first (workers drain before the gateway goes)
    stop_grace_s: float = 15.0  # SIGTERM -> SIGKILL
    on_exit: ExitHook | None = None


class Fatal(RuntimeError):
    """A child whose exit the stack cannot survive (or any exit before it was ready)."""

    def __init__(self, message: str, exit: Exit) -> None:
        super().__init__(message)
        self.exit = exit


@dataclass
class Child:
    """The supervisor's state for one spec across its incarnations."""

    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    started_at: float = 0.0
    quick_failures: int = 0
    restart_at: float | None = None
    exits: list[Exit] = field(default_factory=list)
    log: IO[bytes] | None = None  # this incarnation's handle on its log file

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Has it exited? Without reaping it (WNOWAIT), so its group id stays its own."""
    if proc.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # already reaped elsewhere
    return info is not None and info.si_pid != 0


def _reap(proc: subprocess.Popen[bytes]) -> int:
    """Kill what the exited child left in its process group, then reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    """Owns the children of one ``ferry up``; ``poll()`` often, ``stop()`` once."""

    def __init__(
        self, policy: RestartPolicy | None = None, log_dir: Path | None = None,
        report: Callable[[str], None] = _stderr, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.log_dir = log_dir
        self.report = report
        self.clock = clock
        self.children: dict[str, Child] = {}
        self.supervising = False  # until the stack is ready, any exit is fatal
        self._stopping = False

    def start(self, spec: ChildSpec) -> Child:
        child = self.children[spec.name] = Child(spec)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        if self.log_dir is not None:  # one file across incarnations, appended to
            child.log = open(self.log_dir / f"{child.spec.name}.log", "ab")  # noqa: SIM115
        env = dict(child.spec.env) if child.spec.env is not None else None
        child.proc = subprocess.Popen(
            child.spec.command(child.incarnation), stdout=child.log,
            stderr=subprocess.STDOUT if child.log else None, env=env,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        child.started_at, child.restart_at = self.clock(), None

    def poll(self) -> list[Exit]:
        """Reap exited children, schedule their restarts, start those that are due.
        Raises :class:`Fatal` for an exit the stack cannot survive."""
        exits = []
        for child in self.children.values():
            if child.proc is not None and _exited(child.proc):
                exits.append(self._on_exit(child))
            elif child.proc is None and child.restart_at is not None \
                    and self.clock() >= child.restart_at and not self._stopping:
                child.incarnation += 1
                self._spawn(child)
                self.report(f"{child.spec.name} restarted (pid {child.pid}, "
                            f"restart {child.incarnation})")
        return exits

    def _on_exit(self, child: Child) -> Exit:
        assert child.proc is not None
        pid, code = child.proc.pid, _reap(child.proc)
        ran_s = self.clock() - child.started_at
        child.proc = None
        child.close_log()
        restart = child.spec.restart and self.supervising and not self._stopping
        quick = child.quick_failures + 1 if ran_s < self.policy.stable_s else 0
        child.quick_failures = quick
        delay = self.policy.delay(quick) if restart else None
        event = Exit(child.spec.name, child.incarnation, pid, code, ran_s, quick, delay,
                     crash_loop=quick >= self.policy.crash_loop_after)
        child.exits.append(event)
        note = self._run_hook(child.spec, event)
        if delay is None:
            raise Fatal(event.describe() + (f"; {note}" if note else ""), event)
        child.restart_at = self.clock() + delay
        self.report(f"{event.describe()}{f'; {note}' if note else ''}; "
                    f"restarting in {delay:.1f} s")
        if event.crash_loop:
            self.report(f"{child.spec.name} is crash-looping: {quick} exits in a row, each "
                        f"within {self.policy.stable_s:.0f} s of starting; restarts slowed "
                        f"to {delay:.1f} s apart (up to {self.policy.max_s:.0f} s); see its log")
        return event

    def _run_hook(self, spec: ChildSpec, event: Exit) -> str | None:
        if spec.on_exit is None or self._stopping:
            return None
        try:
            return spec.on_exit(event)
        except Exception as exc:  # a bookkeeping failure must not stop supervision
            return f"exit hook failed: {exc!r}"

    def stop(self, grace_scale: float = 1.0) -> None:
        """SIGTERM each stop group in order, SIGKILL what outlives its grace; no restarts."""
        self._stopping = True
        for order in sorted({c.spec.stop_order for c in self.children.values()}):
            group = [c for c in self.children.values()
                     if c.spec.stop_order == order and c.proc is not None]
            if not group:
                continue
            for child in group:
                assert child.proc is not None
                if not _exited(child.proc):
                    child.proc.send_signal(signal.SIGTERM)
            deadline = self.clock() + max(c.spec.stop_grace_s for c in group) * grace_scale
            while any(c.proc is not None and not _exited(c.proc) for c in group) \
                    and self.clock() < deadline:
                time.sleep(0.05)
            for child in group:
                assert child.proc is not None
                _reap(child.proc)  # SIGKILLs the group first if still running
                child.proc = None
                child.close_log()

    def log_tails(self, lines: int = 30) -> str:
        """The end of each child's log file (when logging to files), for a failure report."""
        if self.log_dir is None:
            return ""
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)
