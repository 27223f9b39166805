"""The Batch API's Redis side against a real redis-server: one slot per batch and per file,
owner indexes newest first, fenced progress (a batcher without the lease writes nothing),
and exactly one recorded result per line whoever records it and however often."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from redis.crc import key_slot

from protocol.batch.progress import BatchProgress, LeaseLost, LineResult
from protocol.batch.records import (
    BATCH_ID_RE,
    FILE_ID_RE,
    BatchRecord,
    FileRecord,
    line_request_id,
    new_batch_id,
    new_file_id,
)
from protocol.batch.store import BatchStore
from protocol.keys import Keys
from protocol.models import ID_PATTERN
from tests.redis_server import RedisServer

KEYS = Keys()


def _run(url: str, scenario: Callable[[Any], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = aredis.Redis.from_url(url)
        try:
            return await scenario(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def _batch(owner: str = "anonymous", **fields: Any) -> BatchRecord:
    now = int(time.time())
    base: dict[str, Any] = dict(
        id=new_batch_id(), owner=owner, endpoint="/v1/completions", input_file_id="file-x",
        completion_window="24h", status="in_progress", created_at=now, expires_at=now + 60,
        total=3, lines=3)
    return BatchRecord(**{**base, **fields})


def test_every_key_of_one_batch_or_file_shares_one_slot() -> None:
    batch, file = new_batch_id(), new_file_id()
    batch_keys = [KEYS.batch(batch), KEYS.batch_output(batch), KEYS.batch_errors(batch),
                  KEYS.batch_inflight(batch), KEYS.batch_lease(batch)]
    assert len({key_slot(k.encode()) for k in batch_keys}) == 1
    assert key_slot(KEYS.file(file).encode()) == key_slot(KEYS.file_lines(file).encode())
    assert all(f"{{{batch}}}" in k for k in batch_keys)


def test_ids_sort_by_time_and_line_ids_are_request_ids() -> None:
    import re

    first = new_batch_id()
    time.sleep(0.002)
    second = new_batch_id()
    assert first < second and BATCH_ID_RE.match(first) and FILE_ID_RE.match(new_file_id())
    assert re.match(ID_PATTERN, line_request_id(second, 49_999))


def test_pages_newest_first_and_drop_expired(redis_server: RedisServer,
                                            redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        ids = []
        for _ in range(5):
            record = _batch("alice")
            await store.create_batch(record)
            ids.append(record.id)
            await asyncio.sleep(0.002)
        await store.create_batch(_batch("bob"))
        first, more1 = await store.list_batches("alice", None, 2)
        await r.delete(KEYS.batch(ids[2]))  # expired
        second, more2 = await store.list_batches("alice", first[-1].id, 2)
        rest, more3 = await store.list_batches("alice", second[-1].id, 2)
        with pytest.raises(ValueError, match="already in use"):
            await store.create_batch(_batch("alice", id=ids[0]))
        return ids, first, more1, second, more2, rest, more3, await r.zcard(
            KEYS.batches_of("alice"))

    ids, first, more1, second, more2, rest, more3, indexed = _run(redis_server.url, scenario)
    assert [b.id for b in first] == [ids[4], ids[3]] and more1
    assert [b.id for b in second] == [ids[1], ids[0]] and not more2  # ids[2] dropped
    assert rest == [] and not more3
    assert indexed == 4


def test_transitions_and_the_lease_fence(redis_server: RedisServer,
                                         redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        record = _batch(status="validating")
        await store.create_batch(record)
        a = BatchProgress(r, KEYS, record.id, "a", 60_000)
        b = BatchProgress(r, KEYS, record.id, "b", 60_000)
        got = [await a.acquire(), await b.acquire(), await a.acquire()]
        with pytest.raises(LeaseLost):
            await b.transition(["validating"], "in_progress", 1)
        wrong = await a.transition(["in_progress"], "finalizing", 1)
        ok = await a.transition(["validating"], "in_progress", 7)
        api = await store.transition(record.id, ["validating", "in_progress"], "cancelling")
        missing = await store.transition("batch_000000000000", ["in_progress"], "cancelling")
        await a.release()
        taken = await b.acquire()
        with pytest.raises(LeaseLost):
            await a.renew()
        return got, wrong, ok, api, missing, taken, await store.get_batch(record.id)

    got, wrong, ok, api, missing, taken, final = _run(redis_server.url, scenario)
    assert got == [True, False, True]  # exclusive, and one's own lease can be taken again
    assert (wrong, ok, api, missing, taken) == ("validating", "ok", "ok", "missing", True)
    assert final.status == "cancelling" and final.in_progress_at == 7 and final.cancelling_at


def test_feeding_moves_one_cursor_and_stops_when_the_batch_stops(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        record = _batch(total=10, lines=10)
        await store.create_batch(record)
        p = BatchProgress(r, KEYS, record.id, "a", 60_000)
        await p.acquire()
        out = [await p.feed(0, 3, [0, 2]), await p.feed(0, 5, [3]), await p.feed(3, 4, [3])]
        await store.transition(record.id, ["in_progress"], "cancelling")
        out.append(await p.feed(4, 6, [4, 5]))
        return out, await p.inflight(), (await store.get_batch(record.id)).fed

    out, inflight, fed = _run(redis_server.url, scenario)
    assert out == ["ok", "moved", "ok", "status"]
    assert inflight == [0, 2, 3] and fed == 4


def test_each_line_is_recorded_once_with_its_counts(redis_server: RedisServer,
                                                   redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        record = _batch(total=3, lines=3)
        await store.create_batch(record)
        p = BatchProgress(r, KEYS, record.id, "a", 60_000)
        await p.acquire()
        await p.feed(0, 3, [0, 1, 2])
        first = [LineResult(0, True, '{"a":0}', 5, 7), LineResult(1, False, '{"e":1}')]
        again = [LineResult(0, False, '{"late":0}'), LineResult(1, True, '{"late":1}', 9, 9)]
        counts = await asyncio.gather(p.record(first), p.record(again), p.record(first))
        recorded = await p.recorded([0, 1, 2])
        return counts, recorded, await p.inflight(), await store.get_batch(record.id), \
            await store.result_lines(record.id, True, 0, 2), \
            await store.result_lines(record.id, False, 0, 2)

    counts, recorded, inflight, rec, output, errors = _run(redis_server.url, scenario)
    assert sorted(counts) == [0, 0, 2] and recorded == {0, 1} and inflight == [2]
    assert (rec.completed, rec.failed, rec.prompt_tokens, rec.completion_tokens) == (1, 1, 5, 7)
    assert (rec.output_bytes, rec.error_bytes) == (len('{"a":0}') + 1, len('{"e":1}') + 1)
    assert output == [b'{"a":0}'] and errors == [b'{"e":1}'] and not rec.settled


def test_a_batcher_without_the_lease_records_nothing(redis_server: RedisServer,
                                                    redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        record = _batch()
        await store.create_batch(record)
        stale = BatchProgress(r, KEYS, record.id, "stale", 100)
        await stale.acquire()
        await asyncio.sleep(0.2)  # its lease ran out; another batcher takes the batch
        fresh = BatchProgress(r, KEYS, record.id, "fresh", 60_000)
        assert await fresh.acquire()
        lost = []
        for call in (stale.record([LineResult(0, True, "{}")]), stale.feed(0, 1, [0]),
                     stale.update(total=99), stale.reserve_files("file-o", "file-e")):
            try:
                await call
            except LeaseLost:
                lost.append(True)
        return lost, await store.get_batch(record.id)

    lost, rec = _run(redis_server.url, scenario)
    assert lost == [True] * 4
    assert (rec.completed, rec.fed, rec.total, rec.output_file_id) == (0, 0, 3, None)


def test_finalize_names_files_once_and_sets_ttls(redis_server: RedisServer,
                                                redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        record = _batch(status="finalizing", total=1, lines=1)
        await store.create_batch(record)
        p = BatchProgress(r, KEYS, record.id, "a", 60_000)
        await p.acquire()
        await p.record([LineResult(0, True, "{}")])
        await p.reserve_files("file-first", "file-err")
        await p.reserve_files("file-second", "file-err2")
        wrong = await p.finalize(["cancelling"], "cancelled", 5, 100, 50)
        ok = await p.finalize(["finalizing"], "completed", 5, 100, 50)
        ttls = [await r.ttl(KEYS.batch(record.id)), await r.ttl(KEYS.batch_output(record.id))]
        return wrong, ok, ttls, await store.get_batch(record.id)

    wrong, ok, ttls, rec = _run(redis_server.url, scenario)
    assert (wrong, ok) == ("finalizing", "ok")
    assert 90 <= ttls[0] <= 100 and 40 <= ttls[1] <= 50
    assert rec.status == "completed" and rec.completed_at == 5
    assert rec.output_file_id == "file-first" and rec.error_file_id is None  # no error line


def test_files_pages_by_purpose_and_live_while_a_batch_needs_them(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    async def scenario(r: Any) -> Any:
        store = BatchStore(r, KEYS)
        now = int(time.time())
        made = []
        for purpose in ("batch", "batch_output", "batch"):
            record = FileRecord(id=new_file_id(), owner="o", purpose=purpose, filename="f",
                                bytes=2, created_at=now, expires_at=now + 100, lines=1)
            await store.append_lines(record.id, [b"{}\n"], 100)
            await store.save_file(record, 100)
            made.append(record.id)
            await asyncio.sleep(0.002)
        inputs, _ = await store.list_files("o", None, 10, purpose="batch")
        oldest, more = await store.list_files("o", None, 1, desc=False)
        await store.extend_file(made[0], now + 1000)
        await store.extend_file(made[0], now + 10)  # never shortens
        extended = await store.get_file(made[0]), await r.ttl(KEYS.file_lines(made[0]))
        await store.delete_file(extended[0])
        return made, inputs, oldest, more, extended, await r.exists(KEYS.file_lines(made[0]))

    made, inputs, oldest, more, (rec, lines_ttl), left = _run(redis_server.url, scenario)
    assert [f.id for f in inputs] == [made[2], made[0]]
    assert [f.id for f in oldest] == [made[0]] and more
    assert rec.expires_at == int(rec.created_at) + 1000 and lines_ttl > 900
    assert left == 0
