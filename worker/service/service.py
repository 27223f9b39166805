"""The worker service: the engine loop, wired to the intake, outbox, control and tokenizer
threads.

The loop owns the engine (which is single-threaded) and never touches Redis: between two
steps it drains its mailbox (new requests from the intake, cancels and lost leases from
the control thread and the outbox), enforces deadlines, steps, and hands the step's events
to the outbox. So a slow or unreachable Redis never stalls a forward pass, and the GPU
batch takes new requests at every iteration. See ``docs/service.md``.
"""

from __future__ import annotations

import functools
import logging
import pickle
import queue
import threading
import time
from typing import Any

import structlog

from protocol.keys import Keys
from protocol.store import ensure_group
from worker.engine import DeviceFault, Engine
from worker.service.affinity.setup import affinity_board
from worker.service.intake.dead_letters import DeadLetters
from worker.service.intake.fair_ledger import FairLedger
from worker.service.intake.prompt_pool import PromptPool, build_with
from worker.service.intake.slots import Slots
from worker.service.intake.thread import Intake
from worker.service.job_table import JobTable
from worker.service.jobs import Admission, Command
from worker.service.metrics.lora import LoraMetrics
from worker.service.metrics.prometheus import WorkerMetrics
from worker.service.metrics.stats import ServiceCounters, StatsBook
from worker.service.outbox.thread import Observer, Outbox
from worker.service.output_proc.link import EXIT_OUTPUT_DIED, OutputDied, OutputLink
from worker.service.redis.connection import (
    TRANSIENT_ERRORS,
    Backoff,
    LazyClusterClient,
    WorkerSettings,
    recover,
)
from worker.service.redis.leases import HeldEntries, hand_back
from worker.service.redis.shard_gate import ShardGate, ShardWatch
from worker.service.sidecars.control import Control
from worker.service.sidecars.draft_feed import DraftFeed
from worker.service.sidecars.lora_sync import LoraSync
from worker.service.sidecars.tokenizer_responder import TokenizerResponder

log = structlog.get_logger("ferry.worker")

EXIT_DEVICE_FAULT = 70  # EX_SOFTWARE: the device broke; the supervisor restarts the worker


class WorkerService:
    """``WorkerService(engine, settings).run()`` serves until ``request_stop()``."""

    def __init__(
        self, engine: Engine, settings: WorkerSettings, metrics: WorkerMetrics | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.metrics.bind(settings.model_name, settings.worker_id)  # vllm:* series' labels
        self.log = log.bind(worker_id=settings.worker_id)
        self.mailbox: queue.Queue[Admission | Command] = queue.Queue()
        self.held = HeldEntries()
        self.slots = Slots(engine.config.scheduler.max_num_seqs, settings.prefetch)
        self.dead = DeadLetters(settings)
        self.gate = ShardGate(settings)  # the shards every thread skips while they are lost
        self.watch = ShardWatch(settings, self.gate)
        self.outbox = Outbox(settings, self.held, self.mailbox, observer, self.gate)
        self.prompts = PromptPool(build_with(engine.prompts), self.mailbox,
                                  decode=engine.prompts.decode)
        self.ledger = FairLedger()
        self.affinity = affinity_board(engine, settings, self.metrics)
        self.intake = Intake(settings, self.held, self.slots, self.mailbox, self.outbox,
                             engine.has_unfinished_requests, self.dead, self.prompts,
                             self.ledger, self.gate, self.affinity)
        self.book = StatsBook(engine.stats(), self.metrics, self.ledger)
        self.control = Control(settings, self.held, self.mailbox, self._heartbeat_stats,
                               self.gate, self.affinity)
        self.tokenizer_responder = TokenizerResponder(settings, engine.prompts, engine.tokenizer,
                                                      lora=engine.lora)
        self.lora = LoraSync(settings, engine.lora, engine.config.lora_modules)
        self.lora.metrics = LoraMetrics(self.metrics.registry)
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self.metrics_port = 0
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.table = _job_table(self, engine, settings)
        self.table.adapters, self.table.lora_metrics = self.lora, self.lora.metrics
        self.table.affinity = self.affinity.book if self.affinity else None
        self.drafts = _draft_feed(engine, settings)  # None: no speculation, or no fleet

    def _heartbeat_stats(self) -> dict[str, float | int | str]:
        """Control thread: the heartbeat's ``stats``, from the engine and the threads."""
        return self.book.heartbeat_stats(ServiceCounters(
            slots_held=self.slots.held, max_num_seqs=self.slots.total,
            entries_held=len(self.held), queue_depth=self.control.queue_depth,
            queue_lag=self.control.queue_lag, reclaimed=self.intake.reclaimed,
            dead_lettered=self.dead.count,
            outbox_depth=self.outbox.depth + self.table.outbox_depth,
            draining=self.draining, metrics_port=self.metrics_port,
        )) | self.lora.heartbeat \
            | (self.affinity.heartbeat() if self.affinity else {}) \
            | ({"spec_fleet_published": self.drafts.published,
                "spec_fleet_received": self.drafts.received} if self.drafts else {})

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, force: bool = False) -> None:
        """Stop intake and drain (SIGTERM); ``force`` ends the drain now (second signal)."""
        now = time.monotonic()
        if force or self._stop.is_set():
            self._drain_until = now
        else:
            self._drain_until = now + self.settings.drain_timeout_s
        self._stop.set()

    def run(self) -> int:
        """Serve until stopped; returns the process exit code (``EXIT_DEVICE_FAULT`` when
        the device broke: its requests are handed back for another worker to resume)."""
        if not self._connect():
            return 0
        for client in (self.outbox.redis, self.intake.redis, self.control.redis):
            if isinstance(client, LazyClusterClient):
                client.warm()  # while the URL's node answers (see LazyClusterClient)
        self.metrics_port = self.metrics.serve(self.settings.metrics_port,
                                               self.settings.metrics_host)
        self.outbox.start()
        self.control.start()
        self.tokenizer_responder.start()
        self.lora.start()
        if self.drafts is not None:
            self.drafts.start()
        self.intake.start()
        if self.settings.redis_cluster:
            self.watch.start()
        self.log.info("worker_started", model=self.settings.model_name,
                      max_num_seqs=self.slots.total, lease_s=self.settings.lease_s,
                      metrics_port=self.metrics_port or None)
        try:
            self._loop()
        except DeviceFault as exc:
            self.log.error("device_fault", error=str(exc), exit_code=EXIT_DEVICE_FAULT,
                           requests_handed_back=len(self.table.jobs))
            return EXIT_DEVICE_FAULT
        except OutputDied as exc:  # its requests resume from the replay log elsewhere
            self.log.error("output_process_died", error=str(exc), exit_code=EXIT_OUTPUT_DIED,
                           requests_handed_back=len(self.table.jobs))
            return EXIT_OUTPUT_DIED
        finally:
            self._shutdown()
        return 0

    def _connect(self) -> bool:
        """Create the consumer group, waiting for Redis with backoff; False if stopped."""
        backoff = Backoff(cap=5.0)
        r = None
        try:
            while not self._stop.is_set():
                try:
                    r = r or self.settings.connect()  # a cluster client needs a node at once
                    if self._ensure_groups(r):
                        return True
                except TRANSIENT_ERRORS as exc:
                    self.log.warning("redis_unavailable_at_startup", error=str(exc))
                    if r is not None:
                        recover(r)
                    backoff.wait(self._stop)
            return False
        finally:
            if r is not None:
                r.close()

    def _ensure_groups(self, r: Any) -> bool:
        """The consumer groups of every shard that answers (a lost one gets its groups from
        the intake once it is back); True when at least one shard has them."""
        keys = self.settings.keys
        return any([self.gate.run(k, _ensure, r, keys, keys.shard_streams(k), default=False,
                                  redis=r) for k in range(keys.shards)])

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self.engine.check_ranks()  # a tensor-parallel rank gone: DeviceFault, exit
            busy = self.engine.has_unfinished_requests()
            self._drain_mailbox(0.0 if busy else 0.05)
            if self.lora.manager is not None:  # adapters the sync thread loaded or dropped
                self.lora.apply()
            if self.drafts is not None and self.engine.spec is not None:  # the fleet's outputs
                self.drafts.drain(self.engine.spec.store, 8 if busy else 256)
            if self.table.deadlines:  # a request with a deadline (``timeout_s``)
                self.table.expire()
            self.table.poll()  # an output process's stop strings, settled entries (or death)
            if self._stop.is_set() and self._drained():
                return
            if self.engine.has_unfinished_requests():
                self._step()
            if self.affinity is not None and (gone := self.engine.drain_evicted()):
                self.affinity.book.evicted(gone)  # blocks the cache let go: off the board
            self.book.engine_stats = self.engine.stats()  # cheap: counters, lengths

    def _past_drain(self) -> bool:
        return self._drain_until is not None and time.monotonic() >= self._drain_until

    def _drained(self) -> bool:
        if self.intake.is_alive():
            self.intake.stop()
        if self._past_drain():
            return True
        return (not self.intake.is_alive() and not self.prompts.busy and self.mailbox.empty()
                and not self.table.jobs)

    def _drain_mailbox(self, wait: float) -> None:
        try:
            item = self.mailbox.get(timeout=wait) if wait > 0 else self.mailbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Admission):
                self.table.admit(item)
            else:
                self.table.command(item)
            try:
                item = self.mailbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.table.step()
        elapsed = time.perf_counter() - start
        running = len(self.engine.scheduler.running)
        if running != self.slots.running:  # the intake waits for a change only
            self.slots.set_running(running)
        batch, tokens = self.table.events(outputs, time.monotonic())
        if batch:  # none with an output process: it makes the events
            self.outbox.put(batch, self._past_drain)
        self.metrics.observe_step(elapsed, tokens)

    def _token_text(self, token_id: int) -> str:
        return str(self.engine.tokenizer.decode([token_id]))

    # -- shutdown ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop intake, drop what did not finish, flush events, hand entries back."""
        self.intake.stop()
        self.watch.stop()
        self.intake.join(self.settings.idle_block_ms / 1000 + 6)
        self.prompts.close()
        unfinished = self.table.abort_all()
        self.table.close(15.0)  # an output process writes its events, reports their entries
        flushed = self.outbox.close(timeout=10.0)
        usable = [entry for entry in self.held.snapshot()
                  if self.gate.usable(self.gate.shard_of_stream(entry[0]))]
        handed = hand_back(self.settings, usable)
        self.tokenizer_responder.stop()
        self.lora.stop()
        if self.drafts is not None:  # after the drain: its outputs are shared too
            self.drafts.stop()
        self.control.stop()
        self.log.info("worker_stopped", unfinished=unfinished, handed_back=handed,
                      events_flushed=flushed)


def _job_table(service: WorkerService, engine: Engine, settings: WorkerSettings) -> JobTable:
    """The engine loop's job table: in-process events, or (``output_process``) a table
    that hands text, events and their writes to an output process."""
    args = (engine, service.outbox, service.slots, service.held, service.book,
            service.metrics, settings.worker_id, service.token_text, service.log)
    if not settings.output_process:
        return JobTable(*args)
    from worker.engine import decode_spec
    from worker.service.output_proc.remote_table import RemoteJobTable

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    link = OutputLink.start({
        "service": True, "settings": pickle.dumps(settings), "log_level": level,
        "tokenizer": engine.config.model.model, "decode_spec": decode_spec(engine.tokenizer),
    }, hang_s=settings.output_hang_s)
    service.log.info("output_process_started", pid=link.proc.pid)
    return RemoteJobTable(*args, link=link, mailbox=service.mailbox)


def _draft_feed(engine: Engine, settings: WorkerSettings) -> DraftFeed | None:
    """The fleet's draft store, when speculating with ``spec_fleet`` on and a store that
    keeps texts: what the engine stores on finishing a request is also appended to the
    model's stream, with its tenant, for the store's TTL."""
    if engine.spec is None or not settings.spec_fleet or not engine.spec.config.keeps_outputs:
        return None
    feed = DraftFeed(settings, settings.worker_id, engine.spec.config.store_ttl_s,
                     max_entries=settings.spec_fleet_entries)
    engine.spec.on_stored = feed.publish
    return feed


def _ensure(r: Any, keys: Keys, streams: tuple[str, ...]) -> bool:
    ensure_group(r, keys, streams)
    return True
