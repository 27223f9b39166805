"""The gateway bench's synthetic worker: real stream entries in, real fenced pushes out.

It takes the requests the gateway enqueued exactly as a worker does (XREADGROUP in the
consumer group, ``start_job``), then publishes one protocol-correct TokenEvent per stream
per "step" at a controlled rate, through the worker outbox's own ``queue_push`` (the
``FENCED_PUSH`` script: lease check, RPUSH to the replay log, PUBLISH), so the gateway's
gap-filling reads a log exactly like production's. Each event's text is ``<seq:publish
time in us>``, which lets the clients check order and measure latency without a model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from protocol.codec import decode_entry
from protocol.models import JobStatus, TokenEvent, Usage
from protocol.store import as_str, ensure_group, start_job
from protocol.tenants import fair
from worker.service.intake.fair_ledger import fair_fields
from worker.service.jobs import Outgoing
from worker.service.outbox.thread import MAX_BATCH, queue_push
from worker.service.redis.connection import WorkerSettings, execute_scripts
from worker.service.redis.leases import SCRIPTS

CONSUMER = "bench-publisher"


@dataclass(frozen=True)
class PublishPlan:
    """What to publish: ``streams`` requests, ``rate`` events/s in all, for warm-up then
    measurement; ``max_steps`` caps the events per stream (the CI-sized run)."""

    url: str
    streams: int
    rate: float
    warmup_s: float
    measure_s: float
    max_steps: int | None = None


def claim_all(r: redis.Redis, settings: WorkerSettings, n: int, timeout: float = 60.0
              ) -> dict[str, tuple[str, str]]:
    """Read ``n`` entries (normal lane) as a worker would and start their jobs: request id
    -> (stream, entry id)."""
    keys = settings.keys
    held: dict[str, tuple[str, str]] = {}
    ensure_group(r, keys)
    deadline = time.monotonic() + timeout
    while len(held) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(held)} of {n} requests were enqueued")
        entries, _marks = fair.pull(r, keys.requests, keys.group, CONSUMER, n)
        if not entries:
            time.sleep(0.02)
        if entries:
            for entry_id, fields in entries:
                request = decode_entry(fields)
                decision = start_job(r, keys, request.request_id, CONSUMER, settings.ttls,
                                     entry_id=entry_id, stream=keys.requests,
                                     origin=fair_fields(fields)[0])
                if decision != "run":
                    raise RuntimeError(f"{request.request_id}: start_job said {decision}")
                held[request.request_id] = (keys.requests, as_str(entry_id))
    return held


def _push(r: redis.Redis, settings: WorkerSettings, batch: list[Outgoing]) -> int:
    """One pipelined round trip of fenced pushes, like the outbox; returns refusals."""
    chunks = [batch[i:i + MAX_BATCH] for i in range(0, len(batch), MAX_BATCH)]

    def build(pipe: Any) -> None:
        for chunk in chunks:
            queue_push(pipe, settings, chunk)

    replies = execute_scripts(r, build, SCRIPTS)
    return sum(1 for reply in replies for x in (reply if isinstance(reply, list) else [reply])
               if as_str(x) != "ok")


def _terminal(entry_id: tuple[str, str], rid: str, seq: int) -> Outgoing:
    usage = Usage(prompt_tokens=1, completion_tokens=seq, total_tokens=seq + 1)
    event = TokenEvent(request_id=rid, seq=seq, finish_reason="length", usage=usage,
                       worker_id=CONSUMER)
    status = JobStatus(request_id=rid, state="done", finish_reason="length", usage=usage,
                       worker_id=CONSUMER, finished_at=time.time())
    return Outgoing(entry_id, rid, seq, [], "", event=event, status=status)


def publish(plan: PublishPlan, ready: Any = None, go: Any = None) -> dict[str, Any]:
    """Claim every request, wait for ``go``, publish on schedule, finish every stream.

    Returns the schedule actually kept: step count, measurement window (wall clock),
    events published in it, and refusals (which must be 0)."""
    settings = WorkerSettings(redis_url=plan.url, worker_id=CONSUMER)
    r = redis.Redis.from_url(plan.url)
    held = claim_all(r, settings, plan.streams)
    if ready is not None:
        ready.set()
    if go is not None:
        go.wait()
    interval = plan.streams / plan.rate
    start = time.monotonic()
    warm_end, end = start + plan.warmup_s, start + plan.warmup_s + plan.measure_s
    step, refused, window, measured = 0, 0, [0.0, 0.0], 0
    items = sorted(held.items())
    while (now := time.monotonic()) < end and (plan.max_steps is None or step < plan.max_steps):
        due = start + step * interval
        if due > now:
            time.sleep(due - now)
        in_window = warm_end <= time.monotonic() < end
        if in_window and not window[0]:
            window[0] = time.time()
        pub_us = int(time.time() * 1e6)
        batch = [Outgoing(eid, rid, step, [step % 30000 + 1], f"<{step}:{pub_us}>")
                 for rid, eid in items]
        refused += _push(r, settings, batch)
        if in_window:
            measured += len(batch)
            window[1] = time.time()
        step += 1
    refused += _push(r, settings, [_terminal(eid, rid, step) for rid, eid in items])
    r.close()
    return {"steps": step, "window": window, "measured_events": measured, "refused": refused,
            "offered_rate": plan.rate}
