"""Leases on stream entries: who may publish for a request, renewal, hand-back.

A worker *owns* an entry while it is pending under its consumer name in the group's PEL
(XPENDING). Ownership changes only by a claim (XAUTOCLAIM by a reaper, once the entry has
been idle for ``lease_s``), so every write a worker makes for a request is *fenced*: a Lua
script checks, atomically with the write, that the worker still owns the entry and that
the event's ``seq`` is the next one in the replay log. That one check gives three
guarantees at once:

* a worker that lost its lease (SIGSTOP, GC pause, partition) can never publish again for
  that request, even if it wakes up mid-step — no client sees a duplicate token;
* a write retried after its reply was lost (Redis restart) is recognised (``dup``) and
  not applied twice;
* events stay contiguous: ``seq`` must equal the log length before the append.

Renewal (``RENEW_LUA``) is XCLAIM ... JUSTID with min-idle 0 (resets the idle time
without counting a delivery), applied only to entries still owned.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import structlog

from protocol.cluster.nodes import node_pipeline, raise_moved
from protocol.keys import Keys
from worker.service.redis.connection import TRANSIENT_ERRORS, LuaScript, WorkerSettings, text

log = structlog.get_logger("ferry.worker.leases")

# One call per outbox batch (a step's events), which halves the round trip of one script
# call per event (measured: 64 events 1.2 ms instead of 2.3 ms on the dev machine).
# KEYS: per event: its entry's request stream (lane), its events list, its job hash.
# ARGV: group, consumer, events ttl, job ttl, event count, then per event: entry id, seq,
#       msgpack event, tokens channel, n (> 0 for a terminal event: then n job hash
#       field/value pairs follow, and the entry is XACKed and XDELed after the writes).
# Returns one outcome per event: 'ok', 'dup' (already in the log: a retry), 'lost'
# (another consumer owns the entry, or it was acknowledged), 'gap' (seq beyond the log),
# 'foreign' (the job hash names another entry as the job: this entry is a duplicate and
# must never write that job's log, channel or hash).
FENCED_PUSH = LuaScript("""
local out = {}
local a = 5
for i = 1, tonumber(ARGV[5]) do
  local eid, seq, data, chan = ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[a + 4]
  local nf = tonumber(ARGV[a + 5])
  local stream, log, job = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local p = redis.call('XPENDING', stream, ARGV[1], eid, eid, 1)
  local owner = redis.call('HMGET', job, 'entry_id', 'stream')
  if #p == 0 or p[1][2] ~= ARGV[2] then
    out[i] = 'lost'
  elseif owner[1] and (owner[1] ~= eid or owner[2] ~= stream) then
    out[i] = 'foreign'
  else
    local n = redis.call('LLEN', log)
    if n > seq then
      out[i] = 'dup'
    elseif n < seq then
      out[i] = 'gap'
    else
      redis.call('RPUSH', log, data)
      redis.call('EXPIRE', log, ARGV[3])
      redis.call('PUBLISH', chan, data)
      if nf > 0 then
        redis.call('HSET', job, unpack(ARGV, a + 6, a + 5 + 2 * nf))
        redis.call('EXPIRE', job, ARGV[4])
        redis.call('XACK', stream, ARGV[1], eid)
        redis.call('XDEL', stream, eid)
      end
      out[i] = 'ok'
    end
  end
  a = a + 5 + 2 * nf
end
return out
""")

# KEYS: one request stream. ARGV: group, consumer, entry ids. Returns the ids no longer owned.
RENEW = LuaScript("""
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i])
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
""")

HAND_BACK_IDLE_MS = 10**9
"""Idle time given to handed-back entries: past any worker's lease, so the next reaper
pass anywhere (XAUTOCLAIM with min-idle = its lease) takes them at once."""

# KEYS: one request stream. ARGV: group, consumer, idle ms, entry ids. Returns how many.
HAND_BACK = LuaScript("""
local n = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    n = n + 1
  end
end
return n
""")

SCRIPTS = [FENCED_PUSH, RENEW, HAND_BACK]


Entry = tuple[str, str]
"""A stream entry as (request stream, entry id): ids are unique only within one stream."""


class HeldEntries:
    """Entries this worker owns ((stream, entry id) -> request id), from intake until the
    terminal event is written or the lease is lost. The control thread renews exactly these."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Entry, str] = {}
        self._requests: dict[str, Entry] = {}

    def add(self, entry: Entry, request_id: str) -> None:
        with self._lock:
            self._entries[entry] = request_id
            self._requests[request_id] = entry

    def discard(self, entry: Entry) -> str | None:
        with self._lock:
            request_id = self._entries.pop(entry, None)
            if request_id is not None and self._requests.get(request_id) == entry:
                del self._requests[request_id]
            return request_id

    def __contains__(self, entry: object) -> bool:
        with self._lock:
            return entry in self._entries

    def holds_request(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self) -> dict[Entry, str]:
        with self._lock:
            return dict(self._entries)


def by_stream(entries: list[Entry]) -> dict[str, list[str]]:
    """Entry ids grouped by their stream, for the per-stream scripts."""
    grouped: dict[str, list[str]] = {}
    for stream, entry_id in entries:
        grouped.setdefault(stream, []).append(entry_id)
    return grouped


def hand_back(settings: WorkerSettings, entries: list[Entry]) -> int:
    """Shutdown: make still-owned entries claimable by any worker's next reaper pass now,
    instead of after the lease (XCLAIM to ourselves with a huge IDLE). Returns how many."""
    if not entries:
        return 0
    keys = settings.keys
    r = settings.connect()
    handed = 0
    try:
        for stream, ids in by_stream(entries).items():  # one unreachable shard skips only its own
            args = [keys.group, settings.worker_id, HAND_BACK_IDLE_MS, *ids]
            try:
                handed += int(HAND_BACK.run(r, [stream], args))
            except TRANSIENT_ERRORS as exc:
                log.warning("hand_back_failed", error=str(exc), stream=stream,
                            entries=len(ids))
        return handed
    finally:
        r.close()


def hand_back_consumer(r: Any, keys: Keys, consumer: str, page: int = 1000,
                       streams: Sequence[str] | None = None) -> int:
    """Hand back every entry ``consumer`` still owns, in every lane, now instead of after
    the lease.

    For a consumer whose process is known dead (``ferry up`` reaped it): nobody will renew
    its entries, so waiting ``lease_s`` only delays its requests. The same ``HAND_BACK`` as
    a draining worker's, run for the dead consumer's pending entries (XPENDING ...
    consumer). Were the consumer alive after all, nothing breaks: its fenced writes would
    fail as ``lost`` once a reaper claimed the entries; only its work would be wasted."""
    total = 0
    for stream in keys.request_streams if streams is None else streams:
        start = "-"
        while True:
            rows = r.xpending_range(stream, keys.group, start, "+", page, consumername=consumer)
            ids = [text(row["message_id"]) for row in rows]
            if ids:
                total += int(HAND_BACK.run(r, [stream],
                                           [keys.group, consumer, HAND_BACK_IDLE_MS, *ids]))
            if len(ids) < page:
                break
            start = "(" + ids[-1]
    if total:
        r.incr(keys.handbacks)  # the other reapers claim them at their next liveness scan
    return total


def dead_consumers(r: Any, keys: Keys, me: str, min_idle_ms: int) -> list[str]:
    """Consumers that hold entries but whose worker is gone, in every lane.

    Dead means both: its heartbeat key (``keys.worker``) has expired — the control thread
    writes it every beat, whatever the engine loop is doing, so a live worker in a long
    step keeps it — and the consumer has not touched the stream for ``min_idle_ms`` (the
    same TTL). The second condition keeps a Redis restart from making every worker look
    dead at once: the restored keys may have expired during the outage, but the group's
    idle clocks restart, and live workers beat again long before they run out. A consumer
    wrongly judged dead loses only work: its fenced writes come back ``lost``."""
    return without_heartbeat(r, keys, sorted(idle_consumers(r, keys, me, min_idle_ms)))


def idle_consumers(r: Any, keys: Keys, me: str, min_idle_ms: int,
                   streams: Sequence[str] | None = None) -> set[str]:
    """Consumers other than ``me`` holding entries of the lanes (or of ``streams``: one
    shard's, say) and idle on them for ``min_idle_ms``: the suspects of ``dead_consumers``."""
    pipe = r.pipeline(transaction=False) if streams is None else node_pipeline(r, streams[0])
    for stream in keys.request_streams if streams is None else streams:
        pipe.xinfo_consumers(stream, keys.group)
    suspects: set[str] = set()
    for reply in raise_moved(pipe.execute(raise_on_error=False)):
        if isinstance(reply, Exception):  # NOGROUP: the intake recreates the group
            continue
        for row in reply:
            name = text(row["name"])
            if name != me and int(row["pending"]) > 0 and int(row["idle"]) >= min_idle_ms:
                suspects.add(name)
    return suspects


def without_heartbeat(r: Any, keys: Keys, names: list[str]) -> list[str]:
    """The ``names`` whose heartbeat key has expired (their workers are gone)."""
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.worker(name))
    return [name for name, alive in zip(names, pipe.execute(), strict=True) if not alive]


def lost_ids(reply: Any) -> list[str]:
    return [text(x) for x in reply or []]
