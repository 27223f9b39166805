"""The outbox's writes on a Redis Cluster: per master, one script call per step.

On one Redis the whole step is one ``FENCED_PUSH`` call (``worker/service/redis/leases.py``). On
a cluster a request's keys live in its own slot, so the step is grouped by master: one
``FENCED_PUSH_NODE`` call carrying, in order, the events of every request that master
holds, in one pipeline closed by ``WAIT`` when one of them is a terminal event. Masters
are independent: one that is failing over keeps its requests pending (refresh the
topology, back off, resend) while the others' events go out; its requests' shard counts as
lost (``shard_gate.py``) until the shard watch finds its master answering again, so a
master that stays away costs one timeout, not one per step.

The fence moves with the keys. The stream entry, and so the PEL, is in another slot, so
the script cannot ask XPENDING who owns the entry; instead the job hash's ``worker_id``,
which ``START_JOB_LUA`` sets for whoever took the entry last, names the one worker that
may write (``lost`` for everyone else), with the same ``foreign`` and ``seq`` checks as
on one Redis. A reaper that claims an entry runs START_JOB before it reads the log, so a
stalled worker's writes are refused from then on.

What a failover can lose, and how it comes back:

* **The tail of a replay log** (acknowledged by the old master, not yet replicated): the
  next push sees the log shorter than its ``seq`` (``gap:<length>``). The worker keeps
  every event it sent for the requests it holds, so it re-sends the missing ones from the
  log's length on (subscribers drop what they already had, by ``seq``); if they predate
  this worker, the request is dropped and resumed from the log after the lease.
* **A terminal event** whose entry was already acknowledged would be a request that never
  ends: so the entry is XACKed only after ``WAIT`` says a replica has the terminal write
  (when the master has one). If not, the entry stays pending; the reaper's ``START_JOB``
  then says ``skip`` (done: acknowledge it) or ``run`` (lost: resume it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.crc import key_slot
from redis.exceptions import ResponseError, TryAgainError

from protocol.cluster.nodes import refresh_topology
from protocol.codec import status_to_hash
from worker.service.jobs import Outgoing
from worker.service.outbox.cluster_scripts import FENCED_PUSH_NODE, MOVED_UNDER_US
from worker.service.outbox.sent_events import SentEvents
from worker.service.redis.connection import (
    TRANSIENT_ERRORS,
    Backoff,
    WorkerSettings,
    execute_scripts,
    text,
)
from worker.service.redis.leases import Entry
from worker.service.redis.shard_gate import ShardGate

log = structlog.get_logger("ferry.worker.outbox")
TOPOLOGY_RECHECK_S = 5.0  # how often a slot short of replicas has its topology re-read

@dataclass
class _Group:
    """One request's events of a batch (their positions in it), sent as one script call."""

    request_id: str
    entry: Entry
    positions: list[int] = field(default_factory=list)
    resend: list[tuple[int, bytes]] = field(default_factory=list)  # (seq, payload) repairs


class ClusterPusher:
    """Sends outbox batches to a cluster; keeps what it sent for the requests it holds.

    ``push(..., park=True)`` (the outbox) never waits for a master that is away: its
    requests' events are *parked*, in order, and go out with a later push (the events a
    request gets meanwhile join them, so its order holds), at most once per backoff step
    of that master; the other masters' requests keep streaming through a failover."""

    def __init__(self, settings: WorkerSettings, redis: Any,
                 encode: Callable[[Outgoing], bytes], holds: Callable[[str], bool],
                 gate: ShardGate | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = settings.keys
        self.gate = gate or ShardGate(settings)
        self.encode = encode
        self.sent = SentEvents(holds)  # to refill a replay log a failover cut short
        self.parked: list[tuple[Outgoing, bytes]] = []
        self._retry_at: dict[str, float] = {}  # master -> when to try it again
        self._backoffs: dict[str, Backoff] = {}
        self._topology_read = 0.0  # when the replicas it counts were last read

    def push(self, batch: list[Outgoing], abandon: threading.Event, claim: bool = False,
             ack: bool = True, park: bool = False, give_up_after_s: float | None = None
             ) -> list[tuple[Outgoing, Any]]:
        """Write the parked events, then ``batch``; returns (event, outcome) for those
        written now: 'ok', 'dup', 'lost', 'foreign', 'gap' or an exception. Without
        ``park`` it retries until every master answered, ``abandon`` is set or
        ``give_up_after_s`` passed (what is left is dropped: nobody saw it, the log decides).
        Terminal events that were written and replicated get their entry acknowledged."""
        items = self.parked + [(out, self.encode(out)) for out in batch]
        self.parked = []
        if not items:
            return []
        outs, payloads = [o for o, _ in items], [d for _, d in items]
        outcomes: list[Any] = [None] * len(items)
        replicated: dict[str, bool] = {}
        pending = self._groups(outs)
        deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
        while pending:
            pending = self._send_round(outs, payloads, pending, outcomes, replicated, claim)
            if not pending or park or abandon.is_set() or (
                    deadline is not None and time.monotonic() > deadline):
                break
            abandon.wait(max(0.01, min(self._retry_at.values(), default=0) - time.monotonic()))
        if park:
            waiting = sorted(i for g in pending for i in g.positions)
            self.parked = [items[i] for i in waiting]
        settled = [(outs[i], outcomes[i]) for i in range(len(items)) if outcomes[i] is not None]
        if ack:
            self._ack_finals(settled, replicated)
        self.sent.remember(settled, dict(zip(map(id, outs), payloads, strict=True)))
        return settled

    def _groups(self, batch: list[Outgoing]) -> list[_Group]:
        groups: dict[tuple[str, Entry], _Group] = {}
        for i, out in enumerate(batch):
            key = (out.request_id, out.entry)
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(out.request_id, out.entry)
            group.positions.append(i)
        return list(groups.values())

    def _send_round(self, batch: list[Outgoing], payloads: list[bytes], groups: list[_Group],
                    outcomes: list[Any], replicated: dict[str, bool], claim: bool
                    ) -> list[_Group]:
        """One pipeline per master that is due; returns the groups still to send."""
        by_node: dict[str, tuple[Any, list[_Group]]] = {}
        retry: list[_Group] = []
        now = time.monotonic()
        for group in groups:
            if not self.gate.usable(self.keys.shard_of(group.request_id)):
                retry.append(group)  # its shard is lost: parked until the watch sees it back
                continue
            try:
                node = self.redis.get_node_from_key(self.keys.job(group.request_id))
            except TRANSIENT_ERRORS:
                retry.append(group)
                continue
            if self._retry_at.get(node.name, 0.0) > now:
                retry.append(group)  # it failed a moment ago: not yet
                continue
            by_node.setdefault(node.name, (node, []))[1].append(group)
        for node, node_groups in by_node.values():
            try:
                replies = self._node_round(node, batch, payloads, node_groups, claim)
            except TRANSIENT_ERRORS as exc:
                self._failed(node.name, exc, len(node_groups))
                for shard in {self.keys.shard_of(g.request_id) for g in node_groups}:
                    self.gate.lost(shard, exc, self.redis)
                retry += node_groups
                continue
            self._retry_at.pop(node.name, None)
            self._backoffs.pop(node.name, None)
            for shard in {self.keys.shard_of(g.request_id) for g in node_groups}:
                self.gate.ok(shard)
            acks = replies[len(node_groups)] if len(replies) > len(node_groups) else None
            for group, reply in zip(node_groups, replies, strict=False):
                if self._settle(group, reply, batch, payloads, outcomes):
                    retry.append(group)
                elif acks is not None:
                    replicated[group.request_id] = int(acks) >= self._replicas(group)
            if acks is not None and any(not replicated.get(g.request_id, True)
                                        for g in node_groups):
                refresh_topology(self.redis)  # a replica it counted on may be gone
        return retry

    def _failed(self, node: str, exc: BaseException, requests: int) -> None:
        """A master did not answer: try it again after a backoff step (capped at 0.5 s: a
        promotion takes seconds, and is noticed soon after), with a fresh topology."""
        backoff = self._backoffs.setdefault(node, Backoff(cap=0.5))
        if backoff.failures == 0:
            log.warning("outbox_master_unavailable", node=node, requests=requests,
                        error=str(exc))
        self._retry_at[node] = time.monotonic() + backoff.next_delay()
        refresh_topology(self.redis)

    def _replicas(self, group: _Group) -> int:
        """Replicas to WAIT for: the configured number, or as many as the slot has (a
        master that just took over may have none left; then there is nothing to wait for)."""
        wanted = self.settings.replication.replicas
        known = self._known_replicas(group)
        if known < wanted and time.monotonic() - self._topology_read > TOPOLOGY_RECHECK_S:
            # Redis lists a replica only once it has synced data, so a worker that started
            # with a fresh cluster would never WAIT: look again, at most every few seconds.
            self._topology_read = time.monotonic()
            refresh_topology(self.redis)
            known = self._known_replicas(group)
        return max(0, min(wanted, known))

    def _known_replicas(self, group: _Group) -> int:
        slot = key_slot(self.keys.job(group.request_id).encode())
        return len(self.redis.nodes_manager.slots_cache.get(slot, [None])) - 1

    def _node_round(self, node: Any, batch: list[Outgoing], payloads: list[bytes],
                    groups: list[_Group], claim: bool) -> list[Any]:
        """One pipeline on ``node``: the script call for its requests, then WAIT if one of
        them ends. Returns the per-request outcome lists (and the WAIT reply last)."""
        client = self.redis.get_redis_connection(node)
        ttls = self.settings.ttls
        args: list[Any] = [self.settings.worker_id, ttls.events_s, ttls.job_s, len(groups)]
        for group in groups:
            args += self._args(group, batch, payloads, claim)
        wait = max((self._replicas(g) for g in groups
                    if any(batch[i].final for i in g.positions)), default=0)

        def build(pipe: Any) -> None:
            FENCED_PUSH_NODE.queue(pipe, [], args)
            if wait:
                pipe.execute_command("WAIT", wait, self.settings.replication.timeout_ms)

        replies = execute_scripts(client, build, [FENCED_PUSH_NODE])
        for reply in replies:
            if isinstance(reply, TRANSIENT_ERRORS) or (
                    isinstance(reply, ResponseError)
                    and any(m in str(reply) for m in MOVED_UNDER_US)):
                raise TryAgainError(str(reply))
            if isinstance(reply, Exception):
                raise reply
        return [*replies[0], *replies[1:]]

    def _args(self, group: _Group, batch: list[Outgoing], payloads: list[bytes],
              claim: bool) -> list[Any]:
        rid = group.request_id
        stream, entry_id = group.entry
        events: list[tuple[int, bytes, dict[str, Any]]] = [
            (seq, data, {}) for seq, data in group.resend]
        for i in group.positions:
            out = batch[i]
            fields = status_to_hash(out.status) if out.status is not None else {}
            events.append((out.seq, payloads[i], fields))
        args: list[Any] = [self.keys.events(rid), self.keys.job(rid), entry_id, stream,
                           self.keys.tokens(rid), "1" if claim else "0", len(events)]
        for seq, data, fields in events:
            args += [seq, data, len(fields)]
            for name, value in fields.items():
                args += [name, value]
        return args

    def _settle(self, group: _Group, reply: Any, batch: list[Outgoing], payloads: list[bytes],
                outcomes: list[Any]) -> bool:
        """Record a group's outcomes; True when it must be sent again (a gap repaired)."""
        if isinstance(reply, Exception):
            for i in group.positions:
                outcomes[i] = reply
            return False
        results = [text(x) for x in reply][len(group.resend):]
        gap = next((r for r in results if r.startswith("gap:")), None)
        if gap is not None:
            repair = self.sent.repair(group.request_id, int(gap[4:]),
                                      batch[group.positions[0]].seq)
            if repair is not None:
                group.resend = repair
                return True
        group.resend = []
        for i, result in zip(group.positions, results, strict=True):
            outcomes[i] = "gap" if result.startswith("gap:") else result
        return False

    def _ack_finals(self, settled: list[tuple[Outgoing, Any]],
                    replicated: dict[str, bool]) -> None:
        """XACK + XDEL the entries of terminal events that are written and replicated;
        the rest stay pending for the reaper (whose START_JOB settles them)."""
        entries = [out.entry for out, outcome in settled
                   if out.final and outcome in ("ok", "dup")
                   and replicated.get(out.request_id, True)]
        if not entries:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry_id in entries:
                pipe.xack(stream, self.keys.group, entry_id)
                pipe.xdel(stream, entry_id)
            pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS as exc:  # the reaper acknowledges them later ('skip')
            log.warning("ack_failed", entries=len(entries), error=str(exc))
