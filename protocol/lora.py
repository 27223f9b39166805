"""The fleet's LoRA adapters in Redis: one hash per served base model (``Keys.lora_adapters``).

A gateway's ``POST /v1/load_lora_adapter`` (after a worker checked the adapter, the
``check_lora`` tokenizer op) or a worker started with ``FERRY_LORA_MODULES`` adds a
``LoraRecord``; ``/v1/unload_lora_adapter`` removes it. Every worker of the model reads the
hash at start and again every few seconds (``worker/service/lora_sync.py``) and loads or
drops adapters to match, so an adapter registered through one gateway is served by every
worker, including workers started afterwards. The path must name the same files on every
worker: a shared volume (docs/operations.md).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.keys import Keys

LORA_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""Adapter names travel as the OpenAI ``model`` field and in metric labels: key-safe only."""


class LoraRecord(BaseModel):
    """One registered adapter: its name (what requests put in ``model``), the directory it
    loads from, the served model it adapts, and when it was registered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=LORA_NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)
    parent: str = Field(min_length=1, max_length=256)
    created: float = Field(default_factory=time.time)

    def encode(self) -> str:
        return self.model_dump_json()


def decode_records(fields: dict[Any, Any]) -> dict[str, LoraRecord]:
    """HGETALL's answer as records by name; an entry that does not parse is skipped (a
    hand-written one from another tool must not stop a worker)."""
    records = {}
    for name, raw in fields.items():
        try:
            record = LoraRecord.model_validate(json.loads(raw))
        except ValueError:
            continue
        key = name.decode() if isinstance(name, bytes) else str(name)
        if record.name == key:
            records[key] = record
    return records


def read_adapters(redis: Any, keys: Keys, model: str) -> dict[str, LoraRecord]:
    """The registered adapters of ``model`` (a synchronous redis client)."""
    return decode_records(redis.hgetall(keys.lora_adapters(model)))


def register_adapter(redis: Any, keys: Keys, record: LoraRecord) -> bool:
    """Add ``record``; False (nothing changed) when its name is already registered."""
    return bool(redis.hsetnx(keys.lora_adapters(record.parent), record.name, record.encode()))


async def aread_adapters(redis: Any, keys: Keys, model: str) -> dict[str, LoraRecord]:
    """``read_adapters`` on an asyncio client."""
    return decode_records(await redis.hgetall(keys.lora_adapters(model)))


async def aregister_adapter(redis: Any, keys: Keys, record: LoraRecord) -> bool:
    """``register_adapter`` on an asyncio client."""
    key = keys.lora_adapters(record.parent)
    return bool(await redis.hsetnx(key, record.name, record.encode()))


async def aunregister_adapter(redis: Any, keys: Keys, model: str, name: str) -> bool:
    """Remove adapter ``name`` of ``model``; False when it was not registered."""
    return bool(await redis.hdel(keys.lora_adapters(model), name))
