"""``ferry top``: collect from a real redis-server with a live heartbeat, render, run once."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import typer
from rich.console import Console
from typer.testing import CliRunner

from ferry.commands import top as top_cmd
from ferry.recovery import Recovery, RestartRecord
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from tests.redis_server import RedisServer

KEYS = Keys()
STATS: dict[str, float | int | str] = dict(
    running=3, waiting=2, kv_blocks_total=1000, kv_blocks_free=100, kv_usage=0.9,
    tokens_per_s=321.5, tokens_generated=5000, steps=900, queue_lag=4, reclaimed=7,
    dead_lettered=1, preemptions=2, max_num_seqs=8, prefix_hit_rate=0.75, kv_blocks_cached=40,
)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def live(server: RedisServer) -> Iterator[redis.Redis]:
    """One live worker heartbeat, one expired id in the set, and a lagging stream."""
    r = server.client()
    r.flushall()
    ensure_group(r, KEYS)
    for i in range(4):
        r.xadd(KEYS.requests, {"data": f"job-{i}".encode()})
    r.xreadgroup(KEYS.group, "gpu-0", {KEYS.requests: ">"}, count=1)
    now = time.time()
    beat = WorkerHeartbeat(worker_id="gpu-0", model="/models/Qwen2.5-0.5B",
                           started_at=now - 60, updated_at=now, stats=STATS)
    pipe = r.pipeline()
    # a long TTL: the installed CLI may take seconds to start on a loaded machine
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=300.0))
    pipe.sadd(KEYS.workers, "gone-worker")  # its heartbeat key has expired
    pipe.execute()
    yield r
    r.close()


def _text(renderable: object, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_collect_reads_heartbeats_and_queue(live: redis.Redis) -> None:
    history = top_cmd.History()
    top_cmd.collect(live, KEYS, history)
    snap = top_cmd.collect(live, KEYS, history)
    assert [w.worker_id for w in snap.workers] == ["gpu-0"]
    worker = snap.workers[0]
    assert worker.stats["running"] == 3 and worker.history == [321.5, 321.5]
    assert 55 < worker.uptime_s < 120 and worker.age_s < 30
    q = snap.queue
    assert (q.depth, q.lag, q.pending, q.consumers, q.group_exists) == (4, 3, 1, 1, True)
    assert live.sismember(KEYS.workers, "gone-worker")  # a monitor never writes


def test_render_shows_every_column(live: redis.Redis) -> None:
    text = _text(top_cmd.render(top_cmd.collect(live, KEYS)))
    for expected in ["gpu-0", "Qwen2.5-0.5B", "3/8", "90.0% of 1000", "321.5",
                     "depth 4", "lag 3", "pending 1", "consumers 1", "fleet 321.5 tok/s"]:
        assert expected in text, expected
    row = next(line for line in text.splitlines() if "gpu-0" in line)
    # lag, reclaimed, dead-lettered, preempt, prefix hit rate + cached blocks, restarts
    assert row.split()[-8:-1] == ["4", "7", "1", "2", "75%", "40b", "0"]
    narrow = _text(top_cmd.render(top_cmd.collect(live, KEYS)), width=80)
    assert "gpu-0" in narrow and "history" not in narrow  # columns dropped, worker kept


def test_restart_records_show_per_process_and_on_the_replacement(live: redis.Redis) -> None:
    """What ``ferry up``'s supervisor writes (``Recovery.record``) is what ``top`` shows: a
    line per restarted process, the count on the worker that replaced the dead one."""
    recovery = Recovery(_url(live), KEYS, "up-7")
    try:
        recovery.record(RestartRecord("worker-0", 2, -9, time.time() - 30, "gpu-0", False))
        recovery.record(RestartRecord("gateway", 4, 1, time.time(), "gateway", True))
        snap = top_cmd.collect(live, KEYS)
        assert [r.process for r in snap.restarts] == ["gateway", "worker-0"]  # most first
        text = _text(top_cmd.render(snap))
        line = next(t for t in text.splitlines() if t.startswith("restarts"))
        assert "worker-0 2x (exit -9, 30 s ago)" in line
        assert "gateway 4x (exit 1" in line and "CRASH LOOP" in line
        row = next(t for t in text.splitlines() if "gpu-0" in t)
        assert row.split()[-2] == "2"
        live.hset(KEYS.restarts, "up-8/worker-1", b"not json")  # ignored, never a crash
        assert len(top_cmd.collect(live, KEYS).restarts) == 2
        recovery.close()  # a clean stop removes its own records
        assert top_cmd.collect(live, KEYS).restarts == []
    finally:
        recovery.close()


def _url(r: redis.Redis) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def test_a_degraded_worker_is_marked(live: redis.Redis) -> None:
    healthy = _text(top_cmd.render(top_cmd.collect(live, KEYS)))
    assert "DEGRADED" not in healthy
    now = time.time()
    beat = WorkerHeartbeat(worker_id="gpu-1", model="/models/Llama-3.1-8B", started_at=now,
                           updated_at=now, stats=STATS | {
                               "degraded": "decode_graphs_unavailable", "decode_graphs": 0})
    pipe = live.pipeline()
    # a long TTL: the installed CLI may take seconds to start on a loaded machine
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=300.0))
    pipe.execute()
    text = _text(top_cmd.render(top_cmd.collect(live, KEYS)))
    marked = [line for line in text.splitlines() if "DEGRADED" in line]
    assert len(marked) == 1 and "decode_graphs_unavailable" in marked[0]


def test_render_empty_redis(server: RedisServer) -> None:
    r = server.client()
    r.flushall()
    snap = top_cmd.collect(r, KEYS)
    assert snap.workers == [] and snap.queue.depth == 0 and not snap.queue.group_exists
    text = _text(top_cmd.render(snap))
    assert "no live worker" in text and "no consumer group yet" in text


def test_sparkline_scales_to_its_maximum() -> None:
    assert top_cmd.sparkline([0, 50, 100]) == "▁▄█"
    assert top_cmd.sparkline([0.0, 0.0]) == "▁▁"
    assert top_cmd.sparkline([]) == ""
    assert len(top_cmd.sparkline([1.0] * 100)) == top_cmd.HISTORY_LEN


def test_history_forgets_departed_workers() -> None:
    history = top_cmd.History(length=2)
    assert history.add("a", 1) == [1]
    assert history.add("a", 2) == [1, 2] and history.add("a", 3) == [2, 3]
    history.forget_except(set())
    assert history.add("a", 4) == [4]


def test_top_once_command_options(server: RedisServer, live: redis.Redis) -> None:
    """The command function with its real typer options, whether or not cli.py registers it."""
    app = typer.Typer()
    app.command()(top_cmd.top)
    app.command("noop")(lambda: None)  # two commands: `top` stays a subcommand
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["top", "--redis-url", server.url, "--once"]
    )
    assert result.exit_code == 0, result.output
    assert "gpu-0" in result.output and "depth 4" in result.output


def test_top_reports_unreachable_redis() -> None:
    app = typer.Typer()
    app.command()(top_cmd.top)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["top", "--redis-url", "redis://127.0.0.1:1/0", "--once"])
    assert result.exit_code == 1 and "redis:" in result.output


def test_ferry_top_once_via_the_installed_cli(server: RedisServer, live: redis.Redis) -> None:
    from ferry.cli import app

    names = {c.name or getattr(c.callback, "__name__", "") for c in app.registered_commands}
    if "top" not in names:
        pytest.skip("`top` is not registered in ferry/cli.py yet: app.command('top')(top.top)")
    exe = Path(sys.executable).with_name("ferry")
    cmd = [str(exe)] if exe.exists() else [shutil.which("ferry") or "ferry"]
    out = subprocess.run([*cmd, "top", "--redis-url", server.url, "--once"],
                         capture_output=True, text=True, timeout=60, env={"COLUMNS": "200",
                         "PATH": str(exe.parent)})
    assert out.returncode == 0, out.stderr
    assert "gpu-0" in out.stdout and "depth 4" in out.stdout


def test_prefix_cell_shows_the_host_tier() -> None:
    """A worker with a KV host tier shows the blocks it holds next to the device's."""
    base = dict(prefix_hit_rate=0.5, kv_blocks_cached=40)
    assert top_cmd._prefix(base).plain == "  50% 40b"
    tier = dict(base, kv_host_blocks_total=500, kv_host_blocks_cached=120)
    assert top_cmd._prefix(tier).plain == "  50% 40b +120h"


def test_a_workers_lora_adapters_are_listed(live: redis.Redis) -> None:
    now = time.time()
    beat = WorkerHeartbeat(worker_id="gpu-7", model="/models/base", started_at=now,
                           updated_at=now, stats=STATS | {"lora_adapters": "sql,support",
                                                         "spec_accept_len": 2.5})
    pipe = live.pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=300.0))
    pipe.execute()
    text = _text(top_cmd.render(top_cmd.collect(live, KEYS)))
    assert [line for line in text.splitlines() if "LoRA sql support" in line]
    assert [line for line in text.splitlines() if "spec 2.50 tok/step" in line]


def test_affinity_cell_shows_routes_and_the_board() -> None:
    """Pulls by affinity / stolen after the steal time, and the advertised chunks; a dash
    for a worker with affinity off."""
    stats = dict(affinity_pulled=12, affinity_stolen=3, affinity_advertised=640)
    assert top_cmd._affinity(stats).plain == "12/3 640c"
    assert top_cmd._affinity({}).plain == "-"
    view = top_cmd.WorkerView(worker_id="w", model="m", uptime_s=1.0, age_s=0.5,
                              stats=stats, history=[])
    assert _text(top_cmd._worker_cells(view, [])["affinity"]).strip() == "12/3 640c"
