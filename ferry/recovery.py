"""What ``ferry up`` does in Redis when its supervisor reaps a child: hand back a dead worker's
entries, drop its heartbeat, and record the restart for ``ferry top``.

Why hand back at once: a worker's entries wait out its lease (30 s) before a reaper may
take them, because in general nobody knows whether a silent worker is dead or just slow.
``ferry up`` does know: it reaped the process. So it runs the draining worker's own
``HAND_BACK`` for the dead consumer's pending entries (``leases.hand_back_consumer``), and
the next reaper pass anywhere (at most ``min(lease/2, 5 s)`` later, or the replacement's
first pass) resumes them from their replay logs, output identical. The heartbeat is
deleted too, so ``/readyz`` and ``ferry top`` count live workers right away.

Restart records live in one HASH (``Keys.restarts``), a field per supervised process of
each launcher (``up-<pid>/worker-0``), JSON so ``redis-cli HGETALL ferry:restarts`` reads
it. They expire a day after the last write and a stack's fields are removed when it stops.
Consumers of dead incarnations are deleted from the group once they own nothing, so
``XINFO GROUPS`` (and KEDA, ``ferry top``) do not count them forever.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from ferry.supervisor import Exit
from protocol.keys import Keys
from protocol.store import as_str, remove_heartbeat

RESTARTS_TTL_S = 24 * 3600


@dataclass(frozen=True)
class RestartRecord:
    """How often one supervised process was restarted, and how it last ended."""

    process: str  # "worker-0", "gateway"
    restarts: int
    last_exit: int  # exit code; negative: the signal that killed it
    last_exit_at: float  # unix time
    current: str  # what runs next: the replacement's worker id, or the process name
    crash_loop: bool

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> RestartRecord | None:
        """None for anything that is not a record (a monitor must not crash on it)."""
        try:
            data = json.loads(raw)
            return cls(process=str(data["process"]), restarts=int(data["restarts"]),
                       last_exit=int(data["last_exit"]),
                       last_exit_at=float(data["last_exit_at"]), current=str(data["current"]),
                       crash_loop=bool(data["crash_loop"]))
        except (ValueError, TypeError, KeyError):
            return None


def read_restarts(r: Any, keys: Keys) -> list[RestartRecord]:
    """Every record in the hash, most restarted first (``ferry top``)."""
    records = [RestartRecord.decode(v) for v in r.hgetall(keys.restarts).values()]
    found = [rec for rec in records if rec is not None]
    return sorted(found, key=lambda rec: (-rec.restarts, rec.process))


class Recovery:
    """The Redis side of one launcher's supervision (``launcher`` names it: ``up-<pid>``)."""

    def __init__(self, redis_url: str, keys: Keys, launcher: str) -> None:
        import redis

        from protocol.cluster.nodes import cluster_client

        connect = cluster_client if keys.cluster else redis.Redis.from_url
        self.redis = connect(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.keys = keys
        self.launcher = launcher
        self._fields: set[str] = set()
        self._dead_consumers: set[str] = set()
        self._next_prune = 0.0

    def tick(self, interval_s: float = 10.0) -> None:
        """From the launcher's loop: now and then, prune dead consumers (errors ignored:
        Redis may be restarting; the next tick tries again)."""
        if not self._dead_consumers or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + interval_s
        with contextlib.suppress(Exception):
            self.prune_consumers()

    def worker_died(self, worker_id: str) -> str | None:
        """Hand back the dead consumer's entries and drop its heartbeat; a note for the log
        (None when it owned nothing)."""
        from redis.exceptions import ResponseError

        from worker.service.redis.leases import hand_back_consumer

        try:
            handed = hand_back_consumer(self.redis, self.keys, worker_id)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                return f"entries not handed back ({exc}); they resume after the lease"
            handed = 0  # no request was ever queued: nothing to hand back
        except Exception as exc:  # Redis away: the lease still gets them resumed
            return f"entries not handed back ({exc}); they resume after the lease"
        pipe = self.redis.pipeline(transaction=False)
        remove_heartbeat(pipe, self.keys, worker_id)
        pipe.execute()
        self._dead_consumers.add(worker_id)
        with contextlib.suppress(Exception):  # best effort: tick() tries again
            self.prune_consumers()
        if not handed:
            return None
        return f"handed back {handed} entr{'y' if handed == 1 else 'ies'} of {worker_id}"

    def prune_consumers(self) -> None:
        """Delete dead incarnations' consumers that own nothing any more (safe: their
        processes are gone, so nothing can be delivered to them again)."""
        if not self._dead_consumers:
            return
        still_owning: set[str] = set()
        for stream in self.keys.request_streams:  # every priority lane has its group
            for row in self.redis.xinfo_consumers(stream, self.keys.group):
                name = as_str(row["name"])
                if name not in self._dead_consumers:
                    continue
                if int(row["pending"]) == 0:
                    self.redis.xgroup_delconsumer(stream, self.keys.group, name)
                else:
                    still_owning.add(name)
        self._dead_consumers = still_owning

    def record(self, record: RestartRecord) -> None:
        field = f"{self.launcher}/{record.process}"
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.restarts, field, record.encode())
        pipe.expire(self.keys.restarts, RESTARTS_TTL_S)
        pipe.execute()
        self._fields.add(field)

    def record_exit(self, exit: Exit, current: str) -> str | None:
        """Restart ``exit.next_incarnation`` of a process is coming (``current`` names it);
        returns a note for the log line only if the record could not be written."""
        try:
            self.record(RestartRecord(
                process=exit.name, restarts=exit.next_incarnation, last_exit=exit.code,
                last_exit_at=time.time(), current=current, crash_loop=exit.crash_loop))
        except Exception as exc:  # Redis away: supervision goes on, the log still says it
            return f"restart not recorded in Redis ({exc})"
        return None

    def close(self) -> None:
        """On a clean stop: this stack's records go, and so do its dead consumers."""
        with contextlib.suppress(Exception):  # Redis gone with the stack: nothing to tidy
            if self._fields:
                self.redis.hdel(self.keys.restarts, *self._fields)
        with contextlib.suppress(Exception):
            self.prune_consumers()
        self.redis.close()
