"""The fleet's LoRA adapters in Redis: one hash per served base model (``Keys.lora_adapters``).

A gateway's ``POST /v1/load_lora_adapter`` (after a worker checked the adapter, the
``check_lora`` tokenizer op), the gateway's ``FERRY_LORA_DIR`` resolver, or a worker started
with ``FERRY_LORA_MODULES`` adds a ``LoraRecord``; ``/v1/unload_lora_adapter`` removes it.
Every worker of the model reads the hash at start and again every few seconds
(``worker/service/sidecars/lora_sync.py``) and loads or drops adapters to match, so an adapter
registered through one gateway is served by every worker, including workers started
afterwards. The path must name the same files on every worker: a shared volume
(docs/operations.md).

Adapters are owned. A record's field (its ``name``, the *registry key*) lives in its
owner's namespace as request ids do (``protocol/tenants/ids.py``): a tenant's adapter ``sql``
is ``{tenant}::sql``; a fleet-wide adapter, registered by an operator, keeps its plain
name (``owner`` None), and so do the default tenant's (a gateway without keys, whose
callers act as the operator). A tenant's plain name can never contain ``::``, so no one
can name, replace or squat an adapter in another's namespace. A request carries the
registry key in ``GenerateRequest.model``; callers see their plain name.

``source`` says who registered it: ``modules`` (a worker's own command line: the
operator's, read from wherever it points), ``api`` (the runtime route) or ``dir`` (the
``FERRY_LORA_DIR`` resolver); workers read the last two only from inside their adapter
roots (``protocol/lora/paths.py``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.keys import Keys
from protocol.tenants.ids import DEFAULT_TENANT, SEPARATOR, TENANT_PATTERN, public_id, scoped_id
from protocol.tenants.ids import tenant_of_id as _tenant_of

LORA_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""A registry key: travels as the OpenAI ``model`` field and in metric labels (key-safe)."""

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
"""A caller's adapter name (without ``::``, and not only dots): a tenant's key is at most
40 + 2 + 64 characters, inside ``LORA_NAME_PATTERN``."""

LoraSource = Literal["modules", "api", "dir"]

RegisterOutcome = Literal["added", "replaced", "exists", "full"]


class LoraRecord(BaseModel):
    """One registered adapter: its registry key (what requests put in ``model``), the
    directory it loads from, the served model it adapts, when it was registered, its owner
    (a tenant, or None: fleet-wide) and who registered it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(pattern=LORA_NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)
    parent: str = Field(min_length=1, max_length=256)
    created: float = Field(default_factory=time.time)
    owner: str | None = Field(default=None, pattern=TENANT_PATTERN)
    source: LoraSource = "api"

    @model_validator(mode="after")
    def _owner_matches_name(self) -> LoraRecord:
        if self.owner != owner_of(self.name) or self.name.count(SEPARATOR) > 1:
            raise ValueError(f"owner: {self.owner!r} does not own adapter {self.name!r}")
        return self

    @property
    def version(self) -> str:
        """Which registration this is: a name registered again (new weights, even at the
        same path) is another version, which workers load as a new adapter."""
        return f"{self.created!r}|{self.path}"

    def encode(self) -> str:
        return self.model_dump_json()


def owner_of(key: str) -> str | None:
    """The tenant whose namespace registry key ``key`` lies in (None: fleet-wide)."""
    return _tenant_of(key) if SEPARATOR in key else None


def adapter_key(tenant: str | None, name: str) -> str:
    """The registry key of ``tenant``'s adapter ``name`` (None or the default tenant: the
    plain, fleet-wide name). ``ValueError`` for a name holding ``::``."""
    if SEPARATOR in name:
        raise ValueError(f"lora_name: {name!r} must not contain {SEPARATOR!r}")
    return scoped_id(tenant or DEFAULT_TENANT, name)


def public_name(tenant: str | None, key: str) -> str:
    """The name ``tenant`` knows registry key ``key`` by (the inverse of ``adapter_key``)."""
    return public_id(tenant or DEFAULT_TENANT, key)


def decode_records(fields: dict[Any, Any]) -> dict[str, LoraRecord]:
    """HGETALL's answer as records by registry key; an entry that does not parse is
    skipped (a hand-written one from another tool must not stop a worker)."""
    records = {}
    for name, raw in fields.items():
        try:
            record = LoraRecord.model_validate(json.loads(raw))
        except (ValueError, TypeError, RecursionError):
            continue
        key = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if record.name == key:
            records[key] = record
    return records


def read_adapters(redis: Any, keys: Keys, model: str) -> dict[str, LoraRecord]:
    """The registered adapters of ``model`` (a synchronous redis client)."""
    return decode_records(redis.hgetall(keys.lora_adapters(model)))


def register_adapter(redis: Any, keys: Keys, record: LoraRecord) -> bool:
    """Add ``record`` with no limit (a worker's own modules); False (nothing changed) when
    its name is already registered."""
    added = bool(redis.hsetnx(keys.lora_adapters(record.parent), record.name, record.encode()))
    if added:
        redis.sadd(keys.lora_models(), record.parent)
    return added


# KEYS[1] the model's hash. ARGV: key, record, mode ('add' | 'replace'), the owner's
# prefix ('' for fleet-wide names: count the keys without '::'), the limit (-1: none).
# Returns 1 added, 2 replaced, 0 exists (mode add), -1 the owner has `limit` already.
REGISTER_LUA = """
local exists = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
if exists then
  if ARGV[3] ~= 'replace' then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return 2
end
local limit = tonumber(ARGV[5])
if limit >= 0 then
  local n, prefix = 0, ARGV[4]
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if prefix == '' then
      if not string.find(field, '::', 1, true) then n = n + 1 end
    elseif string.sub(field, 1, #prefix) == prefix then
      n = n + 1
    end
  end
  if n >= limit then return -1 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

_OUTCOMES: dict[int, RegisterOutcome] = {1: "added", 2: "replaced", 0: "exists", -1: "full"}


async def aread_adapters(redis: Any, keys: Keys, model: str) -> dict[str, LoraRecord]:
    """``read_adapters`` on an asyncio client."""
    return decode_records(await redis.hgetall(keys.lora_adapters(model)))


async def aregister_adapter(redis: Any, keys: Keys, record: LoraRecord, limit: int | None,
                            replace: bool = False) -> RegisterOutcome:
    """Add ``record`` (or, with ``replace``, put it over a record of the same key) unless
    its owner's namespace already holds ``limit`` adapters of this model (None: no limit),
    in one script, so two gateways cannot overshoot together."""
    owner = record.owner
    prefix = f"{owner}{SEPARATOR}" if owner is not None else ""
    code = await redis.eval(REGISTER_LUA, 1, keys.lora_adapters(record.parent), record.name,
                            record.encode(), "replace" if replace else "add", prefix,
                            -1 if limit is None else limit)
    outcome = _OUTCOMES[int(code)]
    if outcome in ("added", "replaced"):
        await redis.sadd(keys.lora_models(), record.parent)
    return outcome


async def aunregister_adapter(redis: Any, keys: Keys, model: str, name: str) -> bool:
    """Remove adapter ``name`` (a registry key) of ``model``; False when it was not
    registered."""
    return bool(await redis.hdel(keys.lora_adapters(model), name))


async def aread_adapter_models(redis: Any, keys: Keys) -> list[str]:
    """The base models adapters were ever registered for (a gateway that knows no served
    model yet reads their hashes)."""
    members = await redis.smembers(keys.lora_models())
    return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
