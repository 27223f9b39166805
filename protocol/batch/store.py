"""The Batch API's Redis commands for the HTTP side: files, batches, owner indexes.

Scripts touch the keys of one file or one batch only (one hash tag, so one Redis Cluster
slot). Commands that span an owner index or the active set and an object are separate
calls: a crash between them leaves an index entry without its object, which readers drop
(``_page``). The batcher's side (leases, feeding, results) is ``protocol/batch/progress.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from protocol.batch.records import BatchRecord, FileRecord
from protocol.keys import Keys
from protocol.store import as_str

# KEYS: batch. ARGV: field, value, ... Refuses an id in use.
CREATE_BATCH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: batch, lease. ARGV: batcher ('' = no lease needed: the API's cancel), allowed
# statuses (",a,b,"), new status, its timestamp field, now, field, value, ...
# Returns 'ok', 'lost', 'missing' or the status found when it is not an allowed one.
TRANSITION_LUA = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 'lost' end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if not string.find(ARGV[2], ',' .. status .. ',', 1, true) then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[3], ARGV[4], ARGV[5])
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 'ok'
"""

# KEYS: one key. ARGV: ttl, then what to write: RPUSH of lines to a file being uploaded
# (APPEND) or HSET of a record's fields (SAVE), each with its TTL in the same step.
APPEND_LUA = """
redis.call('RPUSH', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""
SAVE_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""
PUSH_LINES = 1000  # lines per APPEND_LUA call (Lua's unpack takes a few thousand at most)

# KEYS: file, lines. ARGV: expires_at, ttl. Never shortens a file's life.
EXTEND_FILE_LUA = """
local at = redis.call('HGET', KEYS[1], 'expires_at')
if not at then return 0 end
if tonumber(at) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'expires_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return 1
"""


def _page_args(after: str | None, desc: bool) -> tuple[str, str]:
    """ZRANGEBYLEX bounds for the ids after the cursor in the reading direction."""
    if desc:
        return (f"({after}" if after else "+"), "-"
    return (f"({after}" if after else "-"), "+"


class BatchStore:
    """The Batch API's reads and writes over a ``redis.asyncio`` client (bytes replies)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def _eval(self, script: str, keys: Sequence[str], *args: Any) -> Any:
        return await self.redis.eval(script, len(keys), *keys, *args)

    # --- files ---------------------------------------------------------------------------
    async def append_lines(self, file_id: str, lines: list[bytes], ttl_s: int) -> None:
        """RPUSH raw lines (with their line endings) to a file being uploaded."""
        for start in range(0, len(lines), PUSH_LINES):
            await self._eval(APPEND_LUA, [self.keys.file_lines(file_id)], ttl_s,
                             *lines[start:start + PUSH_LINES])

    async def save_file(self, record: FileRecord, ttl_s: int) -> None:
        """Write the record (its lines, if any, are already stored) and index it."""
        fields = [x for pair in record.to_hash().items() for x in pair]
        await self._eval(SAVE_LUA, [self.keys.file(record.id)], ttl_s, *fields)
        await self.redis.zadd(self.keys.files_of(record.owner), {record.id: 0})

    async def get_file(self, file_id: str) -> FileRecord | None:
        fields = await self.redis.hgetall(self.keys.file(file_id))
        return FileRecord.from_hash(fields) if fields else None

    async def read_lines(self, file_id: str, start: int, stop: int) -> list[bytes]:
        """Raw lines ``start`` .. ``stop`` (inclusive) of an uploaded file."""
        return list(await self.redis.lrange(self.keys.file_lines(file_id), start, stop))

    async def extend_file(self, file_id: str, expires_at: int) -> None:
        ttl = max(1, expires_at - int(time.time()))
        await self._eval(EXTEND_FILE_LUA, [self.keys.file(file_id), self.keys.file_lines(file_id)],
                         expires_at, ttl)

    async def delete_file(self, record: FileRecord) -> None:
        """The record and its content: an upload's lines, or the batch results it names."""
        content = self.keys.file_lines(record.id)
        if record.batch_id is not None:
            content = (self.keys.batch_output(record.batch_id) if record.kind == "output"
                       else self.keys.batch_errors(record.batch_id))
        await self.redis.delete(self.keys.file(record.id))
        await self.redis.delete(content)
        await self.redis.zrem(self.keys.files_of(record.owner), record.id)

    async def list_files(self, owner: str, after: str | None, limit: int, desc: bool = True,
                         purpose: str | None = None) -> tuple[list[FileRecord], bool]:
        """A page of the owner's files (newest first unless ``desc`` is False), and
        whether more follow."""
        def keep(fields: dict[Any, Any]) -> bool:
            return purpose is None or as_str(fields.get(b"purpose", b"")) == purpose

        rows, more = await self._page(self.keys.files_of(owner), self.keys.file, after, limit,
                                      desc, keep)
        return [FileRecord.from_hash(r) for r in rows], more

    # --- batches: the API side -----------------------------------------------------------
    async def create_batch(self, record: BatchRecord) -> None:
        fields = [x for pair in record.to_hash().items() for x in pair]
        if not await self._eval(CREATE_BATCH_LUA, [self.keys.batch(record.id)], *fields):
            raise ValueError(f"batch id {record.id!r} is already in use")
        await self.redis.zadd(self.keys.batches_of(record.owner), {record.id: 0})
        await self.redis.zadd(self.keys.batches_active, {record.id: 0})

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        fields = await self.redis.hgetall(self.keys.batch(batch_id))
        return BatchRecord.from_hash(fields) if fields else None

    async def list_batches(self, owner: str, after: str | None,
                           limit: int) -> tuple[list[BatchRecord], bool]:
        rows, more = await self._page(self.keys.batches_of(owner), self.keys.batch, after, limit,
                                      True)
        return [BatchRecord.from_hash(r) for r in rows], more

    async def result_lines(self, batch_id: str, ok: bool, start: int, stop: int) -> list[bytes]:
        """The recorded result lines of lines ``start`` .. ``stop`` (inclusive), in line
        order, from the output (``ok``) or the error results."""
        key = self.keys.batch_output(batch_id) if ok else self.keys.batch_errors(batch_id)
        found = await self.redis.hmget(key, list(range(start, stop + 1)))
        return [line for line in found if line is not None]

    async def active_batches(self) -> list[str]:
        """Batches not yet ended, oldest first: where batchers look for work."""
        return [as_str(i) for i in await self.redis.zrange(self.keys.batches_active, 0, -1)]

    async def owners_and_leases(self, batch_ids: Sequence[str]) -> list[tuple[str | None, bool]]:
        """Each batch's owner (None once its record is gone) and whether a batcher leases
        it, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hget(self.keys.batch(batch_id), "owner")
            pipe.exists(self.keys.batch_lease(batch_id))
        found = await pipe.execute()
        return [(None if found[i] is None else as_str(found[i]), bool(found[i + 1]))
                for i in range(0, len(found), 2)]

    async def inflight_counts(self) -> dict[str, int]:
        """Lines in flight of every active batch (one SCARD each, one round trip)."""
        active = await self.active_batches()
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in active:
            pipe.scard(self.keys.batch_inflight(batch_id))
        return dict(zip(active, (int(n) for n in await pipe.execute()), strict=True))

    async def deactivate(self, batch_id: str) -> None:
        await self.redis.zrem(self.keys.batches_active, batch_id)

    async def transition(self, batch_id: str, allowed: Sequence[str], status: str,
                         now: int | None = None, batcher: str = "",
                         **fields: Any) -> str:
        """Move to ``status`` from one of ``allowed``, stamping ``<status>_at``; returns
        'ok' or why not (the status found, 'missing', 'lost')."""
        extra = [x for name, value in fields.items() for x in (name, str(value))]
        now = int(time.time()) if now is None else now
        out = await self._eval(
            TRANSITION_LUA, [self.keys.batch(batch_id), self.keys.batch_lease(batch_id)],
            batcher, f",{','.join(allowed)},", status, f"{status}_at", now, *extra)
        return as_str(out)

    async def _page(self, index: str, key_of: Any, after: str | None, limit: int, desc: bool,
                    keep: Any = None) -> tuple[list[dict[Any, Any]], bool]:
        """Up to ``limit`` objects after the cursor (those ``keep`` accepts), and whether
        more follow; ids whose object expired are dropped from the index on the way."""
        rows: list[dict[Any, Any]] = []
        cursor = after
        read = self.redis.zrevrangebylex if desc else self.redis.zrangebylex
        while len(rows) <= limit:
            want = limit + 1 - len(rows)
            start, stop = _page_args(cursor, desc)
            ids = [as_str(i) for i in await read(index, start, stop, 0, want)]
            if not ids:
                break
            pipe = self.redis.pipeline(transaction=False)
            for object_id in ids:
                pipe.hgetall(key_of(object_id))
            found = await pipe.execute()
            gone = [i for i, fields in zip(ids, found, strict=True) if not fields]
            if gone:
                await self.redis.zrem(index, *gone)
            rows += [fields for fields in found if fields and (keep is None or keep(fields))]
            if len(ids) < want:
                break
            cursor = ids[-1]
        return rows[:limit], len(rows) > limit
