"""The Batch API's records in Redis: files, batches, their ids and their states.

A file is a HASH (``FileRecord``) plus, for an uploaded file, a LIST of its raw lines; a
batch is a HASH (``BatchRecord``) whose counters and feeding cursor the batcher moves with
scripts (``protocol/batch/store.py``). Fields are plain strings so ``redis-cli HGETALL``
reads them; ``metadata`` and ``errors`` are JSON. Ids start with the creation time in
milliseconds (hex), so sorting ids sorts by age: the owner indexes are sorted sets with
every score 0, read newest first with ``ZREVRANGEBYLEX``, and a cursor (``after``) stays
valid even when the object it names has expired.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
"""Statuses after which nothing changes any more (OpenAI's terminal states)."""

FileKind = Literal["input", "output", "error"]

FILE_ID_RE = re.compile(r"^file-[0-9a-f]{12,64}$")
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{12,64}$")


def _time_ordered_hex() -> str:
    """12 hex digits of milliseconds since the epoch, then 16 random ones."""
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


def new_file_id() -> str:
    return f"file-{_time_ordered_hex()}"


def new_batch_id() -> str:
    return f"batch_{_time_ordered_hex()}"


def line_request_id(batch_id: str, index: int) -> str:
    """The Ferry request id of line ``index`` (0-based) of a batch: deterministic, so a
    batcher that enqueues a line again after a crash is refused (the id is taken) and
    follows the job already there instead of running the line twice."""
    return f"{batch_id}-{index}"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_hash(self) -> dict[str, str]:
        """The HASH fields, without the unset ones (a script may own those)."""
        out: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            out[name] = json.dumps(value) if isinstance(value, dict | list) else str(value)
        return out

    @classmethod
    def from_hash(cls, fields: dict[Any, Any]) -> Any:
        data: dict[str, Any] = {}
        for key, value in fields.items():
            name = key.decode() if isinstance(key, bytes) else str(key)
            text = value.decode() if isinstance(value, bytes) else str(value)
            data[name] = json.loads(text) if name in cls._json_fields() else text
        return cls.model_validate(data)

    @classmethod
    def _json_fields(cls) -> frozenset[str]:
        return frozenset()


class FileRecord(_Record):
    """One file: an upload (``input``) or a batch's output or error file, whose lines are
    the batch's result hashes (``batch_id``)."""

    id: str
    owner: str
    purpose: Literal["batch", "batch_output"]
    filename: str
    bytes: int = Field(ge=0)
    created_at: int
    expires_at: int | None = None
    kind: FileKind = "input"
    lines: int = Field(default=0, ge=0)  # physical lines (input files)
    requests: int = Field(default=0, ge=0)  # non-blank lines (input files)
    batch_id: str | None = None  # output and error files


class BatchRecord(_Record):
    """One batch, as OpenAI's Batch object describes it, plus what the batcher needs:
    ``fed`` (lines before it are enqueued or settled), ``lines`` (physical lines of the
    input file), ``ending`` (``expired`` once the window passed: where finalizing
    leads) and ``failures`` (unexpected failures of its run, over all batchers: past a
    bound the batch is given up). ``total`` counts the requests (non-blank lines);
    ``completed`` and ``failed`` count recorded results, so the batch is done when they
    sum to ``total``."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    output_ttl_s: int | None = None
    model: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    ending: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    fed: int = 0
    lines: int = 0
    failures: int = 0
    output_bytes: int = 0
    error_bytes: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, served from the prefix cache

    @classmethod
    def _json_fields(cls) -> frozenset[str]:
        return frozenset({"metadata", "errors"})

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def settled(self) -> bool:
        """Every request has its one result."""
        return self.completed + self.failed >= self.total
