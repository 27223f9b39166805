"""Files API: upload a batch input file (JSONL), list, retrieve, download and delete files.

An upload's raw lines go to a Redis LIST under the file's TTL (``protocol/batch/store.py``;
docs/operations.md says what that costs), checked on the way: UTF-8, at most
``batch_file_max_lines`` requests (non-blank lines), at most ``batch_file_max_bytes``
(413). Whether each line is a valid request is the batch's business (its error file), as
with OpenAI. A batch's output and error files are listed here too; their content is the
batch's recorded results, in input line order.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from gateway.admission import require_api_key
from gateway.errors import APIError
from gateway.settings import GatewaySettings
from gateway.tenancy.principal import principal
from protocol.batch.records import FILE_ID_RE, FileRecord, new_file_id
from protocol.batch.store import BatchStore

router = APIRouter(prefix="/v1/files", dependencies=[Depends(require_api_key)])

READ_BYTES = 1 << 20  # upload read size
PUSH_BYTES = 1 << 20  # RPUSH at most this much per command
CONTENT_LINES = 1000  # lines per Redis read when downloading
MULTIPART_SLACK = 64 * 1024  # what the body may add to the file (boundaries, other fields)
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 24 * 3600  # OpenAI's bounds for expires_after


def get_store(request: Request) -> BatchStore:
    client = request.app.state.queue.client
    return BatchStore(client.redis, client.keys)


async def owned_file(store: BatchStore, file_id: str, owner: str,
                     param: str = "file_id") -> FileRecord:
    """The caller's file, else 404 (another principal's file does not exist for it)."""
    record = await store.get_file(file_id) if FILE_ID_RE.match(file_id) else None
    if record is None or record.owner != owner:
        raise APIError(404, f"{param}: no file {file_id!r}", param=param)
    return record


def file_object(record: FileRecord) -> dict[str, Any]:
    """OpenAI's File object."""
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": record.created_at, "expires_at": record.expires_at,
            "filename": record.filename, "purpose": record.purpose, "status": "processed",
            "status_details": None}


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.post("")
async def upload_file(http: Request, store: BatchStore = Depends(get_store),
                      owner: str = Depends(principal)) -> dict[str, Any]:
    settings: GatewaySettings = http.app.state.settings
    if not http.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "body: must be multipart/form-data with fields purpose and file",
                       param="file")
    try:
        form = await http.form(max_files=1, max_fields=8, max_part_size=64 * 1024)
    except MultiPartException as exc:
        raise APIError(400, f"body: {exc.message}", param="file") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise APIError(400, f"purpose: only 'batch' is supported, got {purpose!r}",
                           param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file: a file part is required", param="file")
        ttl = _ttl(form, settings)
        record = FileRecord(id=new_file_id(), owner=owner, purpose="batch",
                            filename=(upload.filename or "upload.jsonl")[:256], bytes=0,
                            created_at=int(time.time()))
        record = record.model_copy(update={"expires_at": record.created_at + ttl})
        try:
            record = await _store_lines(upload, store, record, ttl, settings)
        except BaseException:
            await store.redis.delete(store.keys.file_lines(record.id))
            raise
    finally:
        await form.close()
    await store.save_file(record, ttl)
    return file_object(record)


def _ttl(form: Any, settings: GatewaySettings) -> int:
    """``expires_after`` (anchor ``created_at``, 1 hour to 30 days), else the default."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return settings.batch_file_ttl_s
    if anchor != "created_at":
        raise APIError(400, "expires_after.anchor: must be 'created_at'",
                       param="expires_after.anchor")
    if not isinstance(seconds, str) or not seconds.isdigit() or \
            not EXPIRES_MIN_S <= int(seconds) <= EXPIRES_MAX_S:
        raise APIError(400, f"expires_after.seconds: must be an integer from {EXPIRES_MIN_S} "
                       f"to {EXPIRES_MAX_S}", param="expires_after.seconds")
    return int(seconds)


async def _store_lines(upload: UploadFile, store: BatchStore, record: FileRecord, ttl: int,
                       settings: GatewaySettings) -> FileRecord:
    """Read the upload in pieces, check it, and RPUSH its lines (endings kept, so the
    content downloads byte for byte); returns the record with its sizes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = lines = requests = 0
    pending, batch, batch_bytes = b"", [], 0
    while True:
        chunk = await upload.read(READ_BYTES)
        size += len(chunk)
        if size > settings.batch_file_max_bytes:
            raise APIError(413, f"file: larger than the limit of {settings.batch_file_max_bytes} "
                           "bytes", param="file")
        try:
            decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            raise APIError(400, f"file: not UTF-8 text (byte {size - len(chunk)} onwards)",
                           param="file") from None
        parts = (pending + chunk).split(b"\n")
        pending = parts.pop()  # the line not ended yet (at the end: the last, unended one)
        complete = [p + b"\n" for p in parts] + ([pending] if not chunk and pending else [])
        for line in complete:
            lines += 1
            requests += bool(line.strip())
            batch.append(line)
            batch_bytes += len(line)
        if requests > settings.batch_file_max_lines:
            raise APIError(400, f"file: more than {settings.batch_file_max_lines} requests",
                           param="file")
        if batch and (batch_bytes >= PUSH_BYTES or not chunk):
            await store.append_lines(record.id, batch, ttl)
            batch, batch_bytes = [], 0
        if not chunk:
            break
    if requests == 0:
        raise APIError(400, "file: contains no requests (no non-blank line)", param="file")
    return record.model_copy(update={"bytes": size, "lines": lines, "requests": requests})


@router.get("")
async def list_files(
    owner: str = Depends(principal), store: BatchStore = Depends(get_store),
    after: str | None = Query(default=None, max_length=128),
    limit: int = Query(default=10_000, ge=1, le=10_000),
    order: str = Query(default="desc", pattern="^(asc|desc)$"),
    purpose: str | None = Query(default=None, max_length=64),
) -> dict[str, Any]:
    records, more = await store.list_files(owner, after, limit, order == "desc", purpose)
    return list_object([file_object(r) for r in records], more)


@router.get("/{file_id}")
async def retrieve_file(file_id: str, owner: str = Depends(principal),
                        store: BatchStore = Depends(get_store)) -> dict[str, Any]:
    return file_object(await owned_file(store, file_id, owner))


@router.get("/{file_id}/content")
async def file_content(file_id: str, owner: str = Depends(principal),
                       store: BatchStore = Depends(get_store)) -> StreamingResponse:
    record = await owned_file(store, file_id, owner)
    return StreamingResponse(_content(store, record), media_type="application/jsonl")


async def _content(store: BatchStore, record: FileRecord) -> AsyncIterator[bytes]:
    """An upload byte for byte; an output or error file as its result lines, in the input
    file's line order."""
    for start in range(0, record.lines, CONTENT_LINES):
        stop = min(record.lines, start + CONTENT_LINES) - 1
        if record.batch_id is None:
            yield b"".join(await store.read_lines(record.id, start, stop))
        else:
            found = await store.result_lines(record.batch_id, record.kind == "output", start,
                                             stop)
            yield b"".join(line + b"\n" for line in found)


@router.delete("/{file_id}")
async def delete_file(file_id: str, owner: str = Depends(principal),
                      store: BatchStore = Depends(get_store)) -> dict[str, Any]:
    record = await owned_file(store, file_id, owner)
    await store.delete_file(record)
    return {"id": record.id, "object": "file", "deleted": True}
