"""``ferry top``: a live terminal view of the workers, read from their Redis heartbeats.

``ferry/fleet.py`` reads a ``Snapshot`` from Redis (heartbeats, lanes, restarts); this
module only draws it: a row per worker with a tokens/s sparkline, a ``restarts`` column
for the worker incarnation that replaced a dead one, the queue line and a line per
restarted process. ``collect`` and ``render`` are separate, and ``render`` is pure, so
tests can feed it a snapshot and check the frame without a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import typer
from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ferry.fleet import HISTORY_LEN, History, Snapshot, WorkerView, collect
from ferry.recovery import RestartRecord
from protocol.cluster.keys import keys_for
from protocol.cluster.shard_slots import DEFAULT_SHARDS

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = HISTORY_LEN) -> str:
    """Unicode bars scaled to the series' own maximum (an idle worker is a flat line)."""
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


def _num(stats: dict[str, Any], name: str) -> float:
    try:
        return float(stats.get(name, 0) or 0)
    except (TypeError, ValueError):
        return 0.0


def _count(stats: dict[str, Any], name: str, alert: bool = False) -> Text:
    value = int(_num(stats, name))
    return Text(str(value), style="red" if alert and value else "")


def _occupancy(stats: dict[str, Any]) -> Text:
    running, cap = int(_num(stats, "running")), int(_num(stats, "max_num_seqs"))
    label = f"{running}/{cap}" if cap else str(running)
    full = cap > 0 and running >= cap
    return Text(label, style="bold yellow" if full else "")


def _kv(stats: dict[str, Any]) -> Text:
    total = int(_num(stats, "kv_blocks_total"))
    usage = _num(stats, "kv_usage")
    if "kv_usage" not in stats and total:
        usage = (total - _num(stats, "kv_blocks_free")) / total
    style = "bold red" if usage >= 0.95 else "yellow" if usage >= 0.8 else "green"
    return Text(f"{usage * 100:5.1f}% of {total}", style=style)


def _prefix(stats: dict[str, Any]) -> Text:
    """Prefix-cache hit rate (share of admitted prompt tokens not computed) and cached
    blocks; a dash for workers that do not report it."""
    if "prefix_hit_rate" not in stats:
        return Text("-", style="dim")
    rate, cached = _num(stats, "prefix_hit_rate"), int(_num(stats, "kv_blocks_cached"))
    text = f"{rate * 100:4.0f}% {cached}b"
    if _num(stats, "kv_host_blocks_total"):  # the host tier: blocks it holds
        text += f" +{int(_num(stats, 'kv_host_blocks_cached'))}h"
    return Text(text, style="green" if rate >= 0.5 else "")


def _affinity(stats: dict[str, Any]) -> Text:
    """Prefix affinity: pulls offered to this worker by affinity / taken from another's
    offer after the steal time, and the chunk hashes its board advertises; a dash for
    workers with affinity off (or that do not report it)."""
    if "affinity_pulled" not in stats:
        return Text("-", style="dim")
    own, stolen = int(_num(stats, "affinity_pulled")), int(_num(stats, "affinity_stolen"))
    return Text(f"{own}/{stolen} {int(_num(stats, 'affinity_advertised'))}c",
                style="yellow" if stolen > own else "")


# (header, justify, narrowest terminal that shows it); the worker cell holds the model too.
_COLUMNS = [
    ("worker", "left", 0), ("batch", "right", 0), ("wait", "right", 0),
    ("KV used", "right", 0), ("tok/s", "right", 0), ("history", "left", 120),
    ("affinity", "right", 130),
    ("lag", "right", 0), ("reclaim", "right", 0), ("dead", "right", 0),
    ("preempt", "right", 96), ("prefix hit", "right", 110), ("restarts", "right", 96),
    ("beat", "right", 96),
]


def _worker_cells(w: WorkerView, restarts: list[RestartRecord]) -> dict[str, RenderableType]:
    s = w.stats
    restarted = max((r.restarts for r in restarts if r.current == w.worker_id), default=0)
    name = Text(w.worker_id)
    name.append("\n" + w.model.rsplit("/", 1)[-1], style="dim")
    degraded = str(s.get("degraded") or "")
    if degraded:  # serving, but slower than it should: say why, in red
        name.append("\nDEGRADED " + degraded.replace(",", " "), style="bold red")
    accept = _num(s, "spec_accept_len")
    if accept:  # speculative decoding: tokens per drafted row-step
        name.append(f"\nspec {accept:.2f} tok/step", style="cyan")
    adapters = str(s.get("lora_adapters") or "")
    if adapters:  # multi-LoRA: the adapters this worker has loaded (the first few named)
        listed = adapters.split(",")
        loaded = int(_num(s, "lora_adapters_loaded")) or len(listed)
        more = f" (+{loaded - len(listed)})" if loaded > len(listed) else ""
        name.append("\nLoRA " + " ".join(listed) + more, style="magenta")
    return {
        "worker": name, "batch": _occupancy(s), "wait": _count(s, "waiting"), "KV used": _kv(s),
        "tok/s": f"{_num(s, 'tokens_per_s'):.1f}",
        "history": Text(sparkline(w.history), style="cyan"),
        "lag": _count(s, "queue_lag"), "reclaim": _count(s, "reclaimed"),
        "dead": _count(s, "dead_lettered", alert=True), "preempt": _count(s, "preemptions"),
        "prefix hit": _prefix(s), "affinity": _affinity(s),
        "restarts": Text(str(restarted), style="red" if restarted else ""),
        "beat": Text(f"{w.age_s:.0f}s", style="red" if w.age_s > 10 else "dim"),
    }


def _worker_table(snapshot: Snapshot, width: int) -> Table:
    """The per-worker table; columns that do not fit a narrow terminal are left out."""
    table = Table(
        title=f"workers ({len(snapshot.workers)} live)", expand=True, box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    shown = [(name, justify) for name, justify, min_width in _COLUMNS if width >= min_width]
    for name, justify in shown:
        table.add_column(name, justify=justify, no_wrap=True,  # type: ignore[arg-type]
                         overflow="ellipsis", ratio=2 if name == "worker" else None)
    for w in snapshot.workers:
        cells = _worker_cells(w, snapshot.restarts)
        table.add_row(*(cells[name] for name, _ in shown))
    if not snapshot.workers:
        table.add_row("(no live worker)", *[""] * (len(shown) - 1))
    return table


def _queue_line(snapshot: Snapshot) -> Text:
    q = snapshot.queue
    total_tps = sum(_num(w.stats, "tokens_per_s") for w in snapshot.workers)
    lag = "unknown" if q.lag is None else str(q.lag)
    line = Text(f"ferry top — {snapshot.prefix}:requests  ", style="bold")
    line.append(f"depth {q.depth}  lag {lag}  pending {q.pending}  consumers {q.consumers}  ")
    line.append(f"dead letters {q.dead_letters}  ", style="red" if q.dead_letters else "")
    line.append(f"fleet {total_tps:.1f} tok/s", style="green")
    if not q.group_exists:
        line.append("  (no consumer group yet)", style="dim")
    return line


def _shards_line(snapshot: Snapshot) -> Text | None:
    """``shards  0 @127.0.0.1:7000 depth 3 lag 1  1 @... LOST 12 s``; None on one Redis."""
    if not snapshot.shards:
        return None
    line = Text("shards ", style="bold")
    for s in snapshot.shards:
        if s.lost is not None:
            line.append(f" {s.shard} @{s.node} LOST {s.lost_for_s:.0f} s ", style="bold red")
        else:
            line.append(f" {s.shard} @{s.node} depth {s.depth} lag {s.lag} ")
    if snapshot.heartbeats_lost:
        line.append(f" ({snapshot.heartbeats_lost})", style="bold red")
    return line


def _tenants_line(snapshot: Snapshot) -> Text | None:
    """``tenants  a 40 waiting (w 3, vtc 120)  b 4 waiting (...)``; None if none waits."""
    if not snapshot.tenants:
        return None
    line = Text("tenants ", style="bold")
    for t in snapshot.tenants[:12]:
        line.append(f" {t.tenant} {t.waiting} waiting (w {t.weight:g}, vtc {t.counter:.0f}) ")
    if len(snapshot.tenants) > 12:
        line.append(f" +{len(snapshot.tenants) - 12} more", style="dim")
    return line


def _restarts_line(snapshot: Snapshot) -> Text | None:
    """``restarts  worker-0 2x (exit -9, 40 s ago)  gateway 1x (...)``; None if none."""
    if not snapshot.restarts:
        return None
    line = Text("restarts ", style="bold")
    for rec in snapshot.restarts:
        ago = max(0.0, snapshot.taken_at - rec.last_exit_at)
        line.append(f" {rec.process} {rec.restarts}x (exit {rec.last_exit}, {ago:.0f} s ago)",
                    style="bold red" if rec.crash_loop else "yellow")
        if rec.crash_loop:
            line.append(" CRASH LOOP", style="bold red")
    return line


class _Frame:
    """A renderable that lays the table out for the width of the console it lands on."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def __rich_console__(
        self, console: Console, options: ConsoleOptions
    ) -> Iterator[RenderableType]:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.snapshot.taken_at))
        parts: list[RenderableType] = [_queue_line(self.snapshot)]
        for extra in (_shards_line(self.snapshot), _tenants_line(self.snapshot),
                      _restarts_line(self.snapshot)):
            if extra is not None:
                parts.append(extra)
        parts += [_worker_table(self.snapshot, options.max_width), Text(stamp, style="dim")]
        yield Group(*parts)


def render(snapshot: Snapshot) -> RenderableType:
    """One frame: the queue line above the per-worker table."""
    return _Frame(snapshot)


def top(
    redis_url: str = typer.Option(
        "redis://localhost:6379/0", "--redis-url", envvar="FERRY_REDIS_URL", help="Redis URL."
    ),
    prefix: str = typer.Option("ferry", "--prefix", envvar="FERRY_PREFIX", help="Key prefix."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between frames."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    redis_cluster: bool = typer.Option(
        False, "--redis-cluster", envvar="FERRY_REDIS_CLUSTER",
        help="--redis-url names a node of a Redis Cluster."),
    stream_shards: int = typer.Option(
        DEFAULT_SHARDS, "--stream-shards", envvar="FERRY_STREAM_SHARDS",
        help="Cluster: request-stream shards."),
) -> None:
    """Live dashboard of the workers: batch, KV use, tokens/s, queue lag, reclaims."""
    import redis as redis_lib
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    from rich.live import Live

    from protocol.cluster.nodes import cluster_client
    from protocol.cluster.shard_health import ShardHealth

    client: Any
    if redis_cluster:  # a lost shard costs one short wait per frame, not ten long ones
        client = cluster_client(redis_url, socket_timeout=2, socket_connect_timeout=2,
                                retry=Retry(NoBackoff(), 0))
    else:
        client = redis_lib.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    keys = keys_for(prefix, redis_cluster, stream_shards)
    history, console, health = History(), Console(), ShardHealth(keys.shards)
    try:
        if once:
            console.print(render(collect(client, keys, history, health)))
            return
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                live.update(render(collect(client, keys, history, health)), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except redis_lib.RedisError as exc:
        console.print(f"[red]redis: {exc}[/red]")
        raise typer.Exit(1) from None
    finally:
        client.close()
