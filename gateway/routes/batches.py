"""Batches API: create a batch from an uploaded file, follow it, list them, cancel one.

The route only records the batch (``validating``) and puts it in the active set; a
batcher (``ferry batcher``, ``gateway/batcher/driver.py``) validates the lines, feeds them to
the queue on the low lane and writes the results. Objects, statuses and timestamps are
OpenAI's; ``request_counts`` are live (the batcher's counters, moved with each result).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.admission import require_api_key
from gateway.errors import APIError
from gateway.openai_api.schemas import ENDPOINT_SCHEMAS as SCHEMAS
from gateway.routes.files import (
    EXPIRES_MAX_S,
    EXPIRES_MIN_S,
    get_store,
    list_object,
    owned_file,
)
from gateway.settings import GatewaySettings
from gateway.tenancy.principal import principal
from protocol.batch.records import BATCH_ID_RE, BatchRecord, new_batch_id
from protocol.batch.store import BatchStore

router = APIRouter(prefix="/v1/batches", dependencies=[Depends(require_api_key)])

WINDOWS = {"24h": 24 * 3600}
"""The completion windows a batch may ask for (OpenAI's one), in seconds."""
FILE_GRACE_S = 24 * 3600  # the input file outlives the window by this much
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_MIN_S, le=EXPIRES_MAX_S)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(max_length=128)
    endpoint: str = Field(max_length=128)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    def check(self) -> None:
        if self.endpoint not in SCHEMAS:
            raise APIError(400, f"endpoint: {self.endpoint!r} is not supported (one of "
                           f"{', '.join(SCHEMAS)})", param="endpoint")
        if self.completion_window not in WINDOWS:
            raise APIError(400, f"completion_window: must be one of {', '.join(WINDOWS)}",
                           param="completion_window")
        meta = self.metadata or {}
        if len(meta) > METADATA_PAIRS:
            raise APIError(400, f"metadata: at most {METADATA_PAIRS} pairs", param="metadata")
        for key, value in meta.items():
            if len(key) > METADATA_KEY or len(value) > METADATA_VALUE:
                raise APIError(400, f"metadata.{key[:METADATA_KEY]}: keys are at most "
                               f"{METADATA_KEY} characters, values {METADATA_VALUE}",
                               param="metadata")


def batch_object(rec: BatchRecord) -> dict[str, Any]:
    """OpenAI's Batch object."""
    timestamps = {name: getattr(rec, name) for name in (
        "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
        "failed_at", "expired_at", "cancelling_at", "cancelled_at")}
    return {
        "id": rec.id, "object": "batch", "endpoint": rec.endpoint, "model": rec.model,
        "errors": {"object": "list", "data": rec.errors} if rec.errors else None,
        "input_file_id": rec.input_file_id, "completion_window": rec.completion_window,
        "status": rec.status, "output_file_id": rec.output_file_id,
        "error_file_id": rec.error_file_id, **timestamps,
        "request_counts": {"total": rec.total, "completed": rec.completed,
                           "failed": rec.failed},
        "usage": {"input_tokens": rec.prompt_tokens,
                  "input_tokens_details": {"cached_tokens": rec.cached_tokens},
                  "output_tokens": rec.completion_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": rec.prompt_tokens + rec.completion_tokens},
        "metadata": rec.metadata,
    }


async def owned_batch(store: BatchStore, batch_id: str, owner: str) -> BatchRecord:
    """The caller's batch, else 404 (another principal's batch does not exist for it)."""
    record = await store.get_batch(batch_id) if BATCH_ID_RE.match(batch_id) else None
    if record is None or record.owner != owner:
        raise APIError(404, f"batch_id: no batch {batch_id!r}", param="batch_id")
    return record


@router.post("")
async def create_batch(body: BatchCreate, http: Request, owner: str = Depends(principal),
                       store: BatchStore = Depends(get_store)) -> dict[str, Any]:
    settings: GatewaySettings = http.app.state.settings
    body.check()
    source = await owned_file(store, body.input_file_id, owner, param="input_file_id")
    if source.kind != "input":
        raise APIError(400, f"input_file_id: {source.id!r} is a batch's {source.kind} file, "
                       "not an uploaded input file", param="input_file_id")
    now = int(time.time())
    window = settings.batch_completion_window_s or WINDOWS[body.completion_window]
    record = BatchRecord(
        id=new_batch_id(), owner=owner, endpoint=body.endpoint, input_file_id=source.id,
        completion_window=body.completion_window, status="validating", created_at=now,
        expires_at=now + window, metadata=body.metadata,
        output_ttl_s=body.output_expires_after.seconds if body.output_expires_after else None)
    await store.extend_file(source.id, record.expires_at + FILE_GRACE_S)
    await store.create_batch(record)
    return batch_object(record)


@router.get("")
async def list_batches(owner: str = Depends(principal), store: BatchStore = Depends(get_store),
                       after: str | None = Query(default=None, max_length=128),
                       limit: int = Query(default=20, ge=1, le=100)) -> dict[str, Any]:
    """Newest first; ``after`` is the last id of the previous page."""
    records, more = await store.list_batches(owner, after, limit)
    return list_object([batch_object(r) for r in records], more)


@router.get("/{batch_id}")
async def retrieve_batch(batch_id: str, owner: str = Depends(principal),
                         store: BatchStore = Depends(get_store)) -> dict[str, Any]:
    return batch_object(await owned_batch(store, batch_id, owner))


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, owner: str = Depends(principal),
                       store: BatchStore = Depends(get_store)) -> dict[str, Any]:
    """``cancelling`` (the batcher stops feeding, cancels what runs, then ``cancelled``);
    a batch already cancelling or cancelled is answered as it is; 409 once it has ended
    otherwise (or is finalizing: every line has its result)."""
    record = await owned_batch(store, batch_id, owner)
    found = await store.transition(batch_id, ["validating", "in_progress"], "cancelling")
    if found not in ("ok", "cancelling", "cancelled"):
        raise APIError(409, f"batch_id: {batch_id!r} cannot be cancelled: it is {found}",
                       param="batch_id")
    return batch_object(await store.get_batch(batch_id) or record)
