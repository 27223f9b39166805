"""``ferry/supervisor.py`` with real child processes (tiny shell commands), no model:
restart with backoff, crash-loop reports, fatal children, process groups, ordered stop."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ferry.supervisor import ChildSpec, Exit, Fatal, RestartPolicy, Supervisor

FAST = RestartPolicy(initial_s=0.05, factor=2.0, max_s=0.2, stable_s=60.0, crash_loop_after=3)


def _sh(script: str) -> Callable[[int], list[str]]:
    return lambda n: ["sh", "-c", script, "sh", str(n)]  # $1 is the incarnation


def _poll_until(sup: Supervisor, done: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "supervisor never got there"
        sup.poll()
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for init."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_restarts_with_exponential_backoff_and_reports_the_crash_loop(tmp_path: Path) -> None:
    lines: list[str] = []
    seen: list[Exit] = []
    sup = Supervisor(FAST, log_dir=tmp_path, report=lines.append)
    sup.supervising = True
    hook = lambda e: seen.append(e) or f"note {e.incarnation}"  # noqa: E731
    child = sup.start(ChildSpec("w", _sh('echo "run $1"; exit 3'), on_exit=hook))
    try:
        _poll_until(sup, lambda: len(child.exits) >= 5)
    finally:
        sup.stop()
    exits = child.exits[:5]
    assert [e.code for e in exits] == [3] * 5
    assert [e.incarnation for e in exits] == [0, 1, 2, 3, 4]
    assert [e.quick_failures for e in exits] == [1, 2, 3, 4, 5]
    assert [e.restart_in_s for e in exits] == [0.05, 0.1, 0.2, 0.2, 0.2]  # doubling, capped
    assert [e.crash_loop for e in exits] == [False, False, True, True, True]
    assert seen[:5] == exits  # the hook saw every exit, with its incarnation
    log = (tmp_path / "w.log").read_text().split()  # one log file across incarnations
    assert [log[i + 1] for i in range(0, 10, 2)] == ["0", "1", "2", "3", "4"]
    assert any("w (pid" in ln and "exited with code 3" in ln and "note 0" in ln
               and "restarting in 0.1 s" in ln for ln in lines), lines
    assert sum("crash-looping" in ln for ln in lines) >= 3
    assert any(ln.startswith("w restarted (pid") for ln in lines)


def test_a_run_longer_than_stable_resets_the_backoff(tmp_path: Path) -> None:
    policy = RestartPolicy(initial_s=0.05, factor=2.0, max_s=10.0, stable_s=1.0)
    sup = Supervisor(policy, report=lambda _line: None)
    sup.supervising = True
    # incarnations 0 and 1 exit at once, 2 runs past stable_s, 3 exits at once again
    child = sup.start(ChildSpec("w", _sh('[ "$1" = 2 ] && sleep 1.5; exit 1')))
    try:
        _poll_until(sup, lambda: len(child.exits) >= 4)
    finally:
        sup.stop()
    assert [e.quick_failures for e in child.exits[:4]] == [1, 2, 0, 1]
    assert [e.restart_in_s for e in child.exits[:4]] == [0.05, 0.1, 0.05, 0.05]


def test_fatal_child_and_any_exit_before_supervising() -> None:
    sup = Supervisor(FAST, report=lambda _line: None)
    sup.start(ChildSpec("early", _sh("exit 2")))
    with pytest.raises(Fatal, match=r"early \(pid \d+\) exited with code 2") as info:
        _poll_until(sup, lambda: False)
    assert info.value.exit.restart_in_s is None
    sup.supervising = True
    sup.start(ChildSpec("redis", _sh("exit 0"), restart=False))
    with pytest.raises(Fatal, match=r"redis \(pid \d+\) exited with code 0"):
        _poll_until(sup, lambda: False)
    sup.stop()


def test_a_killed_child_is_described_by_its_signal_and_restarted() -> None:
    lines: list[str] = []
    sup = Supervisor(FAST, report=lines.append)
    sup.supervising = True
    child = sup.start(ChildSpec("w", lambda n: ["sleep", "300"]))
    try:
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _poll_until(sup, lambda: child.pid not in (None, first))
        assert child.exits[0].code == -signal.SIGKILL
        assert "exited with code -9 (SIGKILL)" in lines[0]
        assert child.incarnation == 1
    finally:
        sup.stop()
    assert child.pid is None and _gone(first)


def test_an_exit_takes_its_process_group_along(tmp_path: Path) -> None:
    """What a dead child left running (uvicorn's worker processes, say) must not keep the
    port: the supervisor kills the child's group before reaping it."""
    pid_file = tmp_path / "grandchild"
    sup = Supervisor(FAST, report=lambda _line: None)
    sup.supervising = True
    script = f'[ "$1" = 0 ] || exec sleep 300; sleep 300 & echo $! > {pid_file}; sleep 0.2'
    child = sup.start(ChildSpec("w", _sh(script)))
    try:
        _poll_until(sup, lambda: len(child.exits) >= 1)
        grandchild = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while not _gone(grandchild):
            assert time.monotonic() < deadline, "the orphan outlived its group leader"
            time.sleep(0.02)
    finally:
        sup.stop()


def test_stop_goes_in_order_kills_the_stubborn_and_restarts_nothing(tmp_path: Path) -> None:
    order = tmp_path / "order"
    sup = Supervisor(FAST, report=lambda _line: None)
    sup.supervising = True
    polite = f'trap "echo $0 >> {order}; exit 0" TERM; while :; do sleep 0.05; done'
    first = sup.start(ChildSpec("first", lambda n: ["sh", "-c", polite, "first"], stop_order=0))
    second = sup.start(ChildSpec("second", lambda n: ["sh", "-c", polite, "second"],
                                 stop_order=1))
    stubborn = sup.start(ChildSpec("stubborn", lambda n: ["sh", "-c", 'trap "" TERM; sleep 300'],
                                   stop_order=2, stop_grace_s=0.3))
    pids = [c.pid for c in (first, second, stubborn)]
    time.sleep(0.3)  # let the shells install their traps
    sup.stop()
    assert order.read_text().split() == ["first", "second"]
    assert all(c.proc is None for c in (first, second, stubborn))
    assert all(_gone(p) for p in pids if p is not None)
    assert sup.poll() == [] and all(c.proc is None for c in (first, second, stubborn))


def test_a_failing_hook_does_not_stop_supervision() -> None:
    lines: list[str] = []
    sup = Supervisor(FAST, report=lines.append)
    sup.supervising = True

    def broken(_exit: Exit) -> str:
        raise ConnectionError("redis away")

    child = sup.start(ChildSpec("w", _sh("exit 1"), on_exit=broken))
    try:
        _poll_until(sup, lambda: child.incarnation >= 1)
    finally:
        sup.stop()
    assert "exit hook failed: ConnectionError('redis away')" in lines[0]


def test_policy_delay() -> None:
    policy = RestartPolicy(initial_s=1.0, factor=2.0, max_s=60.0)
    assert [policy.delay(n) for n in (0, 1, 2, 3, 6, 7, 20)] == [1, 1, 2, 4, 32, 60, 60]
