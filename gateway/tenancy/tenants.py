"""Tenants: who owns each API key, with its weight in the fair share and its quotas.

Three ways to configure them, decided once at startup:

* no keys: one tenant, the default one (``protocol.tenants.ids.DEFAULT_TENANT``), no quotas:
  nothing changes for a gateway without authentication;
* ``FERRY_API_KEYS=k1,k2``: each key is its own tenant, named ``key-`` and 16 hex digits
  of an HMAC-SHA256 of the key under the deployment's naming secret
  (``gateway.tenancy.naming``, kept in Redis): the same on every gateway and across
  restarts, and nothing a guessed key can be checked against (an unsalted hash of the key
  was: a weak key fell to a word list). Weight 1;
* ``FERRY_TENANTS_FILE``: a TOML file naming tenants with their keys' SHA-256 (never the
  keys), a weight and optional quotas (``docs/tenants.md``)::

      [tenants.search]
      keys_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
      weight = 3
      max_concurrent = 64
      tokens_per_minute = 200000
      max_priority = 0
      lora_adapters = ["support-v2"]   # optional: the fleet-wide LoRA adapters it may use
      max_lora_adapters = 4            # optional: LoRA adapters of its own it may load
      admin = false                    # true: its keys register fleet-wide adapters

A bad file stops the gateway and ``ferry batcher`` at startup with the tenant and field
named: weights must be finite and within ``protocol.tenants.fair``'s range, names printable
characters of ``protocol.tenants.ids.TENANT_PATTERN``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from protocol.lora.registry import ADAPTER_NAME_PATTERN
from protocol.tenants.fair import check_weight
from protocol.tenants.ids import DEFAULT_TENANT, TENANT_PATTERN

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"keys_sha256", "weight", "max_concurrent", "tokens_per_minute", "max_priority",
           "lora_adapters", "prefix_cache_group", "max_lora_adapters", "admin"}


@dataclass(frozen=True)
class Tenant:
    """One tenant: its id (part of Redis key names), share weight and quotas (None: none)."""

    id: str
    weight: float = 1.0
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    max_priority: int | None = None  # the lowest ``priority`` value (highest lane) allowed
    lora_adapters: frozenset[str] | None = None  # fleet-wide adapters it may use (None: all)
    # the prefix-cache space it shares with the group's other tenants (None: its own)
    prefix_cache_group: str | None = None
    max_lora_adapters: int | None = None  # adapters of its own (None: see own_adapter_limit)
    admin: bool = False  # an operator for LoRA: its loads are fleet-wide

    def may_use_adapter(self, name: str) -> bool:
        """Whether this tenant may use the fleet-wide LoRA adapter ``name`` (its allowlist,
        if any). Its own adapters need no allowance."""
        return self.lora_adapters is None or name in self.lora_adapters

    def own_adapter_limit(self, default: int) -> int:
        """How many adapters of its own this tenant may register per served model: its
        ``max_lora_adapters``, else 0 when it has an allowlist (a load by path reads any
        adapter under the roots, the allowlisted fleet-wide ones included), else
        ``default``."""
        if self.max_lora_adapters is not None:
            return self.max_lora_adapters
        return 0 if self.lora_adapters is not None else default

    @property
    def wire(self) -> str | None:
        """``GenerateRequest.tenant`` for this tenant's requests (None: the default)."""
        return None if self.id == DEFAULT_TENANT else self.id


DEFAULT = Tenant(DEFAULT_TENANT)


def key_sha256(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_tenant_id(api_key: str, secret: bytes) -> str:
    """``key-`` and 16 hex digits of HMAC-SHA256(``secret``, the key): the tenant of a
    ``FERRY_API_KEYS`` key. Without the secret, a label says nothing about the key."""
    return "key-" + hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class TenantDirectory:
    """API key hash -> tenant; no table and no keys: no authentication, every caller is
    DEFAULT. ``FERRY_API_KEYS`` keys wait in ``unnamed_keys`` until ``named`` gives their
    tenants the names the deployment's secret derives (``needs_secret`` until then)."""

    by_hash: tuple[tuple[str, Tenant], ...] | None = None
    unnamed_keys: tuple[str, ...] = field(default=(), repr=False)

    @property
    def authenticated(self) -> bool:
        return self.by_hash is not None or bool(self.unnamed_keys)

    @property
    def needs_secret(self) -> bool:
        return bool(self.unnamed_keys)

    def named(self, secret: bytes) -> TenantDirectory:
        """The directory with every ``FERRY_API_KEYS`` key's tenant named (``key_tenant_id``);
        two keys whose names collide (a 1 in 2^64 chance) are refused, not merged."""
        if not self.unnamed_keys:
            return self
        keys = tuple(dict.fromkeys(self.unnamed_keys))
        table = tuple((key_sha256(k), Tenant(key_tenant_id(k, secret))) for k in keys)
        if len({t.id for _, t in table}) != len(table):
            raise ValueError("api_keys: two keys got the same tenant name; replace one")
        return TenantDirectory((*(self.by_hash or ()), *table))

    def tenant(self, tenant_id: str | None) -> Tenant:
        """The tenant named on a request (``None``, or an unknown id: weight 1, no quotas)."""
        for _hash, tenant in self.by_hash or ():
            if tenant.id == tenant_id:
                return tenant
        return DEFAULT if tenant_id in (None, DEFAULT_TENANT) else Tenant(str(tenant_id))

    def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant of ``api_key``; None if it is no tenant's key. Every stored hash is
        compared, in constant time, so timing reveals neither the key nor the match."""
        if not self.authenticated:
            return DEFAULT
        if self.needs_secret:
            raise RuntimeError("the FERRY_API_KEYS tenants are not named yet (named())")
        if not api_key:
            return None
        digest = key_sha256(api_key).encode()
        found = None
        for stored, tenant in self.by_hash or ():
            if hmac.compare_digest(digest, stored.encode()):
                found = tenant
        return found

    @classmethod
    def from_keys(cls, api_keys: tuple[str, ...]) -> TenantDirectory:
        """``FERRY_API_KEYS``' directory, its tenants still to be ``named``."""
        return cls(None, tuple(api_keys))

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"tenants_file: cannot read {str(path)!r}: {exc}") from None
        tenants = doc.get("tenants")
        if not isinstance(tenants, dict) or not tenants:
            raise ValueError("tenants_file: needs at least one [tenants.NAME] table")
        table: list[tuple[str, Tenant]] = []
        for name, spec in tenants.items():
            tenant, hashes = _parse_tenant(name, spec)
            table += [(h, tenant) for h in hashes]
        seen = [h for h, _ in table]
        if len(set(seen)) != len(seen):
            raise ValueError("tenants_file: a key hash is listed under two tenants")
        return cls(tuple(table))


def _parse_tenant(name: str, spec: Any) -> tuple[Tenant, list[str]]:
    where = f"tenants_file: tenants.{name if name.isprintable() else repr(name)}"
    if name == DEFAULT_TENANT or not re.fullmatch(TENANT_PATTERN, name):
        raise ValueError(f"{where}: the name must be printable characters matching "
                         f"{TENANT_PATTERN}, and not {DEFAULT_TENANT!r}")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    hashes = spec.get("keys_sha256")
    if not isinstance(hashes, list) or not hashes or not all(
            isinstance(h, str) and _SHA256_RE.fullmatch(h) for h in hashes):
        raise ValueError(f"{where}.keys_sha256: a non-empty list of lowercase hex SHA-256 "
                         "digests (64 characters each) of the tenant's API keys")
    try:
        weight = check_weight(spec.get("weight", 1))
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
    quotas = {f: _positive_int(where, f, spec.get(f))
              for f in ("max_concurrent", "tokens_per_minute")}
    priority = spec.get("max_priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"{where}.max_priority: must be an integer")
    group = spec.get("prefix_cache_group")
    if group is not None and not (isinstance(group, str) and re.fullmatch(TENANT_PATTERN, group)):
        raise ValueError(f"{where}.prefix_cache_group: a group name matching {TENANT_PATTERN}")
    own, admin = _lora_fields(where, spec)
    return Tenant(name, weight, quotas["max_concurrent"], quotas["tokens_per_minute"],
                  priority, _adapters(where, spec.get("lora_adapters")), group, own,
                  admin), hashes


def _lora_fields(where: str, spec: dict[str, Any]) -> tuple[int | None, bool]:
    """``max_lora_adapters`` (an integer >= 0, or absent) and ``admin`` (a boolean)."""
    own = spec.get("max_lora_adapters")
    if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 0):
        raise ValueError(f"{where}.max_lora_adapters: must be an integer >= 0")
    admin = spec.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}.admin: must be true or false")
    return own, admin


def _adapters(where: str, value: Any) -> frozenset[str] | None:
    """The ``lora_adapters`` allowlist: absent is every adapter, ``[]`` is none."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(n, str) and re.fullmatch(ADAPTER_NAME_PATTERN, n) and "::" not in n
            for n in value):
        raise ValueError(f"{where}.lora_adapters: a list of adapter names matching "
                         f"{ADAPTER_NAME_PATTERN} (without '::')")
    return frozenset(value)


def _positive_int(where: str, field: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}.{field}: must be an integer >= 1")
    return value


def tenant_directory(settings: Any) -> TenantDirectory:
    """The directory ``GatewaySettings`` describe (a file, keys, or no authentication)."""
    if settings.tenants_file:
        if settings.api_keys:
            raise ValueError("tenants_file: set either api_keys or tenants_file, not both "
                             "(list every key in the file)")
        return TenantDirectory.from_file(settings.tenants_file)
    return TenantDirectory.from_keys(tuple(settings.api_keys))
