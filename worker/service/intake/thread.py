"""The intake thread: stream entries -> started jobs, prompts built off the engine loop.

It takes requests through the tenants' fair backlogs (``protocol/tenants/fair.py``, read by
``fair_reader.py``), the priority lanes highest first (``protocol.keys.PRIORITY_BANDS``), and
only as many as the worker can start soon (``Slots``), so a burst spreads over every idle
worker instead of queueing behind the first one's prefills and the fair order is the
fleet's, not this worker's; it BLOCKs long only while the batch is empty, and settles the
real cost of finished requests (``fair_ledger.py``) before each pass's pulls. On a Redis
Cluster each lane has a stream per shard: a pass reads the high lane of every shard before
any normal lane, starting each lane at a shard that moves on every pass (so no shard is
always read last), and BLOCKs briefly on one shard at a time (a blocking read cannot span
slots); a shard that cannot be reached is skipped, the others served, until it answers
again (``shard_gate.py``). Each pass first runs the reaper (``reaper.py``): XAUTOCLAIM
of entries idle past the lease (their worker died or stalled), which are resumed from
their replay log. Entries that cannot be decoded, were delivered too often, or reuse another job's
request id go to the dead-letter stream; the worker keeps going. An entry cancelled before
any worker took it is simply acknowledged and dropped (its ``cancelled`` event was sent by
the cancel itself). Started jobs get their prompt tokenized on the ``PromptPool`` before
they reach the engine loop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from redis.exceptions import ResponseError

from protocol.cluster.nodes import node_client
from protocol.codec import ProtocolError, decode_entry, request_fields
from protocol.keys import PRIORITY_BANDS
from protocol.models import GenerateRequest, TokenEvent
from protocol.store import START_JOB_LUA, ensure_group
from protocol.streaming import decode_log
from protocol.tenants import fair
from protocol.tenants.ids import DEFAULT_TENANT
from worker.service.active_job import ActiveJob
from worker.service.affinity.board_writer import BoardWriter
from worker.service.affinity.chains import prefix_of
from worker.service.intake.dead_letters import DeadLetters
from worker.service.intake.fair_ledger import FairLedger, fair_fields
from worker.service.intake.fair_reader import FairReader
from worker.service.intake.prompt_pool import PromptPool
from worker.service.intake.reaper import Reaper
from worker.service.intake.slots import Slots
from worker.service.jobs import replayed
from worker.service.metrics.affinity import route_of
from worker.service.outbox.thread import Outbox
from worker.service.redis.connection import TRANSIENT_ERRORS, Backoff, WorkerSettings, recover, text
from worker.service.redis.leases import Entry, HeldEntries
from worker.service.redis.shard_gate import ShardGate
from worker.service.ttft_trace import Trace

log = structlog.get_logger("ferry.worker.intake")


class Intake(threading.Thread):
    def __init__(
        self, settings: WorkerSettings, held: HeldEntries, slots: Slots,
        mailbox: queue.Queue[Any], outbox: Outbox, busy: Callable[[], bool],
        dead: DeadLetters, prompts: PromptPool, ledger: FairLedger,
        gate: ShardGate | None = None, affinity: BoardWriter | None = None,
    ) -> None:
        super().__init__(name="ferry-intake", daemon=True)
        self.settings = settings
        self.keys = settings.keys
        self.held = held
        self.slots = slots
        self.mailbox = mailbox
        self.outbox = outbox
        self.busy = busy
        self.dead = dead
        self.prompts = prompts
        self._urgent = set(self.keys.lane_streams("high"))
        # BLOCK must end well before the socket timeout, or a quiet stream looks dead. On a
        # cluster it blocks briefly (busy_block_ms), and a shard that stops answering should
        # cost one short wait: what a dead letter's WAIT for a replica may take, and a bit.
        self.gate = gate or ShardGate(settings)
        self.redis = settings.connect(socket_timeout=(
            settings.replication.timeout_ms / 1000 + 2 if settings.redis_cluster
            else settings.idle_block_ms / 1000 + 5))
        self.stopped = threading.Event()
        self.reaper = Reaper(settings, self.redis, self.gate, self._process)
        self._turn = 0  # the shard each lane is read from first, this pass
        # per entry taken: its id before the fair pull adopted it (or ''), and its charge
        self._fair: dict[Entry, tuple[str, int]] = {}
        self.ledger = ledger
        self.reader = FairReader(settings, self.redis, self.gate)
        self._lanes = {band: set(self.keys.lane_streams(band)) for band in PRIORITY_BANDS}
        self.affinity = affinity  # prefix affinity: routes counted, chunks hashed
        self._traces: dict[Entry, Trace] = {}  # per entry pulled: its TTFT trace so far

    @property
    def reclaimed(self) -> int:
        return self.reaper.reclaimed

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        backoff = Backoff()
        while not self.stopped.is_set():
            try:
                self._tick()
                backoff.reset()
            except TRANSIENT_ERRORS as exc:
                if backoff.failures == 0:
                    log.warning("intake_redis_unavailable", error=str(exc))
                recover(self.redis)
                backoff.wait(self.stopped)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    log.warning("consumer_group_missing_recreating")
                    for k in range(self.keys.shards):  # a lost shard's, once it is back
                        self.gate.run(k, ensure_group, self.redis, self.keys,
                                      self.keys.shard_streams(k), default=None,
                                      redis=self.redis)
                else:
                    log.error("intake_redis_error", error=str(exc))
                    backoff.wait(self.stopped)
            except Exception:  # a bug here must not silently stop all intake
                log.exception("intake_failed")
                backoff.wait(self.stopped)
        self.redis.close()

    def _in_turn(self) -> tuple[list[str], int | None]:
        """Every stream in this pass's reading order, and the shard read first: lanes
        highest first, each lane's shards from a starting shard that moves every pass;
        the shards that are lost left out (None: every one is)."""
        shards = self.keys.shards
        start = self._turn % shards
        self._turn += 1
        rotation = [k for k in [*range(start, shards), *range(start)] if self.gate.usable(k)]
        order: list[str] = []
        for band in PRIORITY_BANDS:
            lane = self.keys.lane_streams(band)
            order += [lane[k] for k in rotation]
        return order, rotation[0] if rotation else None

    def _rooms(self, order: list[str]) -> dict[str, int]:
        """Entries each stream may deliver now (the urgent lane ignores batch room)."""
        free = self.slots.wait_free(timeout=0.2)
        urgent = self.slots.free_urgent()
        return {stream: urgent if stream in self._urgent else free for stream in order}

    def _tick(self) -> None:
        order, first_shard = self._in_turn()
        if first_shard is None:  # every shard is lost: wait for the watch to see one back
            self.stopped.wait(0.2)
            return
        rooms = self._rooms(order)
        if max(rooms.values()) <= 0 or self.stopped.is_set():
            return
        taken = self.reaper.run(max(rooms.values()))
        for k in range(self.keys.shards):  # finished requests' real cost, before picking
            self.gate.run(k, self.ledger.settle, self.redis, set(self.keys.shard_streams(k)),
                          default=0, redis=self.redis)
        for band in PRIORITY_BANDS:  # highest lane first, without blocking
            lane = [stream for stream in order if stream in self._lanes[band]]
            taken += self.reader.pull_lane(lane, rooms, taken, self._pulled)
        if not taken:
            self.reader.wait(first_shard, rooms, self.busy())

    def _pulled(self, stream: str, entries: list[Any]) -> None:
        """Entries a fair pull gave: their routes counted and stamped, then processed."""
        now, me = time.time(), self.settings.worker_id
        for raw_id, fields in entries:
            if fields is not None:
                if self.affinity is not None:
                    self.affinity.metrics.pulled_entry(fields, me)
                self._traces[(stream, text(raw_id))] = Trace(now, *route_of(fields, me))
        try:
            self._process(stream, entries, {})
        finally:  # dispatched ones took theirs; the rest were not started
            self._traces.clear()

    def _process(self, stream: str, entries: list[Any], deliveries: dict[str, int]) -> None:
        """Decode, dead-letter the bad, then start the good ones in one round trip."""
        good: list[tuple[Entry, GenerateRequest]] = []
        for raw_id, fields in entries:
            entry = (stream, text(raw_id))
            if fields is None:  # deleted from the stream while pending: nothing to run
                self.redis.xack(stream, self.keys.group, entry[1])
                continue
            try:
                request = decode_entry(fields)
            except ProtocolError as exc:
                self.dead.undecodable(self.redis, entry, fields, str(exc))
                continue
            if entry in self.held:  # our own entry, reclaimed after renewals failed
                continue
            times = deliveries.get(entry[1], 1)
            if times > self.settings.max_deliveries:
                self.dead.too_many_deliveries(self.redis, entry, fields, request, times)
                continue
            if self.held.holds_request(request.request_id):  # a producer bypassed ENQUEUE_LUA
                self.dead.duplicate(self.redis, entry, fields, request.request_id)
                continue
            self.held.add(entry, request.request_id)
            self._fair[entry] = fair_fields(fields)
            good.append((entry, request))
        if good:
            self._start(good)

    def _start(self, good: list[tuple[Entry, GenerateRequest]]) -> None:
        """start_job + replay log + cancel mark for every entry, in one round trip (on a
        cluster one per master holding their keys: usually one, their shard's).

        If Redis fails midway, the entries not dispatched are released (no longer renewed),
        so a reaper — maybe ours — reclaims them once the lease runs out.
        """
        done = 0
        try:
            replies = self._start_replies(good)
            for i, (entry, request) in enumerate(good):
                decision, log_items, reason = replies[3 * i: 3 * i + 3]
                self._dispatch(entry, request, text(decision), log_items, reason)
                done += 1
        finally:
            for entry, _request in good[done:]:
                self.held.discard(entry)
                self._fair.pop(entry, None)

    def _start_replies(self, good: list[tuple[Entry, GenerateRequest]]) -> list[Any]:
        """The three replies of each entry, in order. Node by node, not a cluster pipeline:
        redis-py would ask its default node for an EVAL's keys first, and that node may be
        the master of a lost shard."""
        keys, now = self.keys, repr(time.time())
        nodes: dict[int, tuple[Any, list[int]]] = {}
        for i, (_entry, request) in enumerate(good):
            client = node_client(self.redis, keys.job(request.request_id))
            nodes.setdefault(id(client), (client, []))[1].append(i)
        replies: list[Any] = [None] * (3 * len(good))
        for client, positions in nodes.values():
            pipe = client.pipeline(transaction=False)
            for i in positions:
                (stream, entry_id), rid = good[i][0], good[i][1].request_id
                origin, _cost = self._fair.get((stream, entry_id), ("", 0))
                pipe.execute_command("EVAL", START_JOB_LUA, 2, keys.job(rid), keys.cancelled(rid),
                                     rid, self.settings.worker_id, now,
                                     self.settings.ttls.job_s, entry_id, stream, origin)
                pipe.lrange(keys.events(rid), 0, -1)
                pipe.get(keys.cancelled(rid))
            got = pipe.execute()
            for j, i in enumerate(positions):
                replies[3 * i: 3 * i + 3] = got[3 * j: 3 * j + 3]
        return replies

    def _dispatch(
        self, entry: Entry, request: GenerateRequest, decision: str, log_items: list[Any],
        reason: Any,
    ) -> None:
        origin, charged = self._fair.pop(entry, ("", fair.DIRECT_COST))
        trace = self._traces.pop(entry, None) or Trace(time.time())  # reclaimed
        if decision == "duplicate":  # another entry owns this request id: leave it alone
            self.held.discard(entry)
            fields = {**request_fields(request), **({"origin": origin} if origin else {})}
            self.dead.duplicate(self.redis, entry, fields, request.request_id,
                                in_flight=False)
            return
        try:
            events = decode_log(log_items)
        except ProtocolError as exc:
            self.held.discard(entry)
            self.dead.unrunnable(self.redis, entry, request, f"replay log unreadable: {exc}")
            return
        admission = replayed(entry, request, events)
        admission.charged = charged
        admission.trace = trace
        if decision == "skip" or (events and events[-1].is_final):
            self.held.discard(entry)
            stream, entry_id = entry
            if cancelled_in_queue(events):  # served nothing: give its tenant the charge back
                self.ledger.note(stream, request.tenant or DEFAULT_TENANT, 0, charged)
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(stream, self.keys.group, entry_id)
            pipe.xdel(stream, entry_id)
            pipe.execute()
        elif decision == "cancel":
            job = ActiveJob(admission, self.settings.worker_id)
            why = text(reason) if reason is not None else "cancelled"
            self.outbox.put([job.final_event("cancelled", error=why)])
        else:
            if events:
                log.info("request_resumed", request_id=request.request_id,
                         next_seq=len(events),
                         prior_tokens=sum(len(v) for v in admission.prior.values()))
            self.slots.take()
            if self.affinity is not None:  # booked by the engine loop at admission
                admission.prefix = prefix_of(request)
            self.prompts.submit(admission)



def cancelled_in_queue(events: list[TokenEvent]) -> bool:
    """The replay log of a request cancelled before any worker took it: the one terminal
    event the cancel script wrote (no worker's id on it)."""
    return (len(events) == 1 and events[0].finish_reason == "cancelled"
            and events[0].worker_id is None)
