"""The load of ``ops/bench/cluster/cluster.py``, run in its own processes: a publisher is one
worker's
outbox, a subscriber is one gateway's pub/sub hub.

Each publisher has its own key prefix (its own streams, group and requests), so several
can claim their requests without taking each other's. It enqueues with the protocol
client, claims the entries as a worker does (XREADGROUP, ``start_job``) and then sends one
event per request per step with the worker's own code until its time is up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from protocol.aclient import AsyncFerryClient
from protocol.client import FerryClient
from protocol.codec import decode_entry
from protocol.models import GenerateRequest
from protocol.store import as_str, start_job
from protocol.tenants import fair
from worker.service.jobs import Outgoing
from worker.service.outbox.cluster_push import ClusterPusher
from worker.service.outbox.thread import encode_outgoing, queue_push
from worker.service.redis.connection import WorkerSettings, execute_scripts
from worker.service.redis.leases import SCRIPTS

CONSUMER = "bench-outbox"


def prefix_of(request_id: str) -> str:
    """``<config>-p<k>-r<i>`` -> ``b<k>``: each publisher's own prefix."""
    return "b" + request_id.rsplit("-p", 1)[1].split("-", 1)[0]


def claim(client: FerryClient, settings: WorkerSettings, rids: list[str]
          ) -> list[tuple[str, tuple[str, str]]]:
    """Enqueue ``rids`` and take them as a worker: (request id, (stream, entry id))."""
    keys, r = settings.keys, client.redis
    client.ensure_group()
    for rid in rids:
        client.enqueue(GenerateRequest(request_id=rid, prompt="x"))
    held: dict[str, tuple[str, str]] = {}
    for stream in keys.request_streams:
        entries, _marks = fair.pull(r, stream, keys.group, CONSUMER, len(rids))
        if entries:
            for entry_id, fields in entries:
                rid = decode_entry(fields).request_id
                decision = start_job(r, keys, rid, CONSUMER, settings.ttls,
                                     entry_id=entry_id, stream=stream)
                assert decision == "run", decision
                held[rid] = (stream, as_str(entry_id))
    assert len(held) == len(rids), f"claimed {len(held)} of {len(rids)}"
    return sorted(held.items())


def publish(url: str, cluster: bool, rids: list[str], seconds: float, results: Any) -> None:
    """One outbox: steps of one event per request, as fast as Redis takes them."""
    prefix = prefix_of(rids[0])
    settings = WorkerSettings(redis_url=url, worker_id=CONSUMER, prefix=prefix,
                              redis_cluster=cluster)
    client = FerryClient.from_url(url, prefix=prefix, cluster=cluster)
    held = claim(client, settings, rids)
    r = client.redis
    pusher = ClusterPusher(settings, r, encode_outgoing, lambda _rid: True) if cluster \
        else None
    stop, refused, events, step = threading.Event(), 0, 0, 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        batch = [Outgoing(entry, rid, step, [step % 30000 + 1], f" t{step}")
                 for rid, entry in held]
        if pusher is not None:
            outcomes = [outcome for _, outcome in pusher.push(batch, stop)]
        else:
            replies = execute_scripts(
                r, lambda pipe, b=batch: queue_push(pipe, settings, b), SCRIPTS)
            outcomes = [as_str(x) for x in replies[0]]
        refused += sum(1 for o in outcomes if o != "ok")
        events += len(batch)
        step += 1
    results.put({"events": events, "seconds": time.monotonic() - start, "refused": refused})
    client.close()


def subscribe(url: str, cluster: bool, rids: list[str], ready: Any, done: Any,
              received: Any) -> None:
    """One gateway hub following every request's token channel, counting messages."""

    async def run() -> None:
        clients: dict[str, AsyncFerryClient] = {}
        inboxes = []
        for rid in rids:
            prefix = prefix_of(rid)
            if prefix not in clients:
                clients[prefix] = AsyncFerryClient.from_url(url, prefix=prefix, cluster=cluster)
            client = clients[prefix]
            inboxes.append(await client.hub.subscribe(client.keys.tokens(rid), 30))
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.05)
            got = sum(len(inbox.take()) for inbox in inboxes)
            with received.get_lock():
                received.value += got
        for client in clients.values():
            await client.aclose()

    asyncio.run(run())

