"""Gateway configuration: one frozen model, built in code or from ``FERRY_*`` variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.tenancy.tenants import tenant_directory
from protocol.cluster.keys import keys_for
from protocol.cluster.nodes import Replication
from protocol.cluster.shard_slots import DEFAULT_SHARDS, MAX_SHARDS
from protocol.keys import Keys
from protocol.lora.paths import adapter_roots
from protocol.store import Ttls

_NONE_WORDS = frozenset({"", "none", "off", "null"})
_LIST_FIELDS = frozenset({"api_keys", "allowed_origins", "admin_keys",
                          "lora_roots"})  # comma-separated in FERRY_*


def _api_keys(raw: str) -> tuple[str, ...]:
    """``FERRY_API_KEYS``' keys (stray commas between keys are harmless). Empty: no keys,
    no authentication; something that names no key (``" , ,, "``) is refused: it used to
    turn authentication off without a word."""
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if raw.strip() and not keys:
        raise ValueError(f"api_keys: FERRY_API_KEYS={raw!r} names no key; leave it empty to "
                         "run without authentication")
    return keys


def _optional(name: str) -> bool:
    """Whether a ``GatewaySettings`` field accepts None (then ``none``/``off`` set it)."""
    return type(None) in getattr(GatewaySettings.model_fields[name].annotation, "__args__", ())


class GatewaySettings(BaseModel):
    """Every knob of the gateway; each field ``x`` can be set by ``FERRY_X`` in the env."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str = "redis://localhost:6379/0"
    redis_cluster: bool = Field(
        default=False, description="Redis Cluster: redis_url names any node (database 0).")
    stream_shards: int = Field(
        default=DEFAULT_SHARDS, ge=1, le=MAX_SHARDS,
        description="Cluster: request-stream shards, the same on every gateway and worker.")
    redis_wait_replicas: int = Field(
        default=1, ge=0, description="Cluster: replicas that must have a request (WAIT) "
        "before it is accepted; 0: accept once on its master.")
    redis_wait_timeout_ms: int = Field(default=2000, ge=1, description="Cluster: WAIT timeout.")
    prefix: str = "ferry"
    api_keys: tuple[str, ...] = Field(
        default=(), description="Empty: no authentication (unless tenants_file); each key "
        "is its own tenant. FERRY_API_KEYS=' , ' (no key) is refused, not read as empty.")
    admin_keys: tuple[str, ...] = Field(
        default=(), description="Operator keys (comma-separated in FERRY_ADMIN_KEYS): they "
        "register and unload fleet-wide LoRA adapters, and any tenant's; no tenant's key "
        "does (docs/tenants.md).")
    metrics_key: str | None = Field(
        default=None, min_length=1, description="Bearer token /metrics requires; None: "
        "/metrics is open without API keys and refused (403) with them.")
    tenants_file: str | None = Field(
        default=None, description="TOML file of tenants: their keys' SHA-256, weights and "
        "quotas (docs/tenants.md); replaces api_keys.")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_prompt_chars: int = Field(default=400_000, ge=1, description="prompt or all messages.")
    max_prompt_tokens: int = Field(default=32_768, ge=1, description="prompt_token_ids length.")
    max_tokens_limit: int = Field(default=8192, ge=1, description="Cap on max_tokens.")
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="Chat without max_tokens: at most this many (None: "
        "max_tokens_limit), and never more than the model's context leaves.")
    max_n: int = Field(default=16, ge=1, le=128, description="Cap on n and best_of.")
    max_prompts: int = Field(
        default=128, ge=1, description="Prompts in one /v1/completions list (each one is "
        "a request of its own).")
    max_messages: int = Field(
        default=4096, ge=1, description="Chat messages per request, checked before any "
        "other validation.")
    stream_hold_s: float = Field(
        default=30.0, ge=0, description="A streamed response's status waits this long for "
        "the request's first event, so a refusal is a 4xx, not an in-band error (0: off).")
    max_queue_lag: int | None = Field(
        default=1000, ge=0, description="Requests waiting for a worker before 429; None: off."
    )
    retry_after_s: int = Field(default=2, ge=0)
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest an HTTP request waits for its job to end."
    )
    timeout_grace_s: float = Field(default=10.0, ge=0, description="Added to a job's timeout_s.")
    keepalive_s: float = Field(default=15.0, gt=0, description="SSE comment when idle this long.")
    disconnect_check_s: float = Field(default=1.0, gt=0)
    poll_interval_s: float = Field(default=1.0, gt=0)
    redis_timeout_s: float = Field(default=5.0, gt=0)
    redis_max_connections: int = Field(
        default=4096, ge=8,
        description="Redis connection pool size, for commands of concurrent requests (the "
        "streams themselves share one pub/sub connection).",
    )
    job_ttl_s: int = Field(default=24 * 3600, ge=1)
    events_ttl_s: int = Field(default=3600, ge=1)
    allowed_origins: tuple[str, ...] = Field(
        default=(), description="Browser origins allowed by CORS (comma-separated in "
        "FERRY_ALLOWED_ORIGINS, ``*`` for any); empty: no CORS headers at all.")
    tokenizer_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="How long /tokenize, /detokenize and "
        "/tokenizer_info wait for a worker's answer before a 503.")
    tokenizer_max_inflight: int = Field(
        default=4, ge=1, le=10_000, description="Tokenizer calls (/tokenize, /detokenize, "
        "/tokenizer_info) one tenant may have in flight across every gateway (or its "
        "max_concurrent, if lower); past it, 429.")
    served_model_name: str | None = Field(
        default=None, max_length=256,
        description="The model name this gateway answers to (besides the names live workers "
        "advertise); requests naming another model get 404.",
    )
    lora_dir: str | None = Field(
        default=None, min_length=1, description="A request naming a model that is neither "
        "served nor a registered LoRA adapter loads $FERRY_LORA_DIR/<name> as an adapter of "
        "the served model on first use (the same shared volume on gateways and workers); "
        "None: 404 as for any unknown model.")
    lora_roots: tuple[str, ...] = Field(
        default=(), description="Directories a lora_path must lie in (comma-separated in "
        "FERRY_LORA_ROOTS; default: lora_dir alone). The gateway refuses a path outside "
        "them at once; the worker, which opens the files, resolves and checks it again.")
    lora_max_adapters_per_tenant: int = Field(
        default=8, ge=0, le=4096, description="LoRA adapters one tenant may register per "
        "served model (a tenants file's max_lora_adapters overrides it).")
    lora_max_fleet_adapters: int = Field(
        default=256, ge=0, le=65536, description="Fleet-wide LoRA adapters (operators' and "
        "FERRY_LORA_DIR's) per served model.")
    # --- Batch API: /v1/files, /v1/batches and the batcher (docs/batch.md) -----------------
    batch_file_max_bytes: int = Field(
        default=100 * 1024 * 1024, ge=1024, description="Largest file /v1/files takes (413).")
    batch_file_max_lines: int = Field(
        default=50_000, ge=1, description="Most requests (non-blank lines) in one file.")
    batch_file_ttl_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="How long an uploaded file is kept unless "
        "its expires_after says otherwise (OpenAI keeps batch files 30 days).")
    batch_ttl_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="How long a batch and its output and "
        "error files are kept once it has ended (unless output_expires_after).")
    batch_completion_window_s: int | None = Field(
        default=None, ge=1, description="Every batch's window in seconds instead of the "
        "24h it asks for (tests shorten it); None: the requested window.")
    batch_max_in_flight: int = Field(
        default=32, ge=1, description="Lines of one batch enqueued and not yet finished.")
    batch_fleet_share: float = Field(
        default=0.25, gt=0, le=1, description="Lines of all batches in flight, at most this "
        "share of the live workers' max_num_seqs summed (interactive requests keep the rest).")
    batch_max_active: int = Field(
        default=8, ge=1, description="Batches one batcher drives at a time.")
    batch_priority: int = Field(
        default=1, ge=1, lt=2**31, description="The lowest priority a batch line runs at "
        "(> 0: the low lane); a line may ask for a larger (later) one.")
    batch_poll_interval_s: float = Field(default=0.25, gt=0)
    batch_lease_s: float = Field(
        default=10.0, gt=0, description="A batch whose batcher died moves to another "
        "batcher after this long.")

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _keys_are_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        """A key nobody can send (blank, or with spaces a bearer header loses)."""
        for key in keys:
            if not key or key != key.strip():
                raise ValueError("a key is blank or has surrounding spaces")
        return keys

    @model_validator(mode="after")
    def _admin_keys_are_no_tenant_keys(self) -> GatewaySettings:
        """One key cannot be both a tenant's and an operator's: the operator's would win."""
        if set(self.admin_keys) & set(self.api_keys):
            raise ValueError("admin_keys: a key is also in api_keys")
        return self

    @property
    def adapter_roots(self) -> tuple[str, ...]:
        """The directories a ``lora_path`` may name (``protocol/lora/paths.py``)."""
        return adapter_roots(self.lora_roots, self.lora_dir)

    @model_validator(mode="after")
    def _lease_outlasts_polls(self) -> GatewaySettings:
        """A batcher renews its leases between ticks: a lease of fewer than four poll
        intervals would run out under a batcher that is merely busy."""
        if self.batch_lease_s < 4 * self.batch_poll_interval_s:
            raise ValueError(f"batch_lease_s: {self.batch_lease_s} must be at least 4 x "
                             f"batch_poll_interval_s ({self.batch_poll_interval_s})")
        return self

    @property
    def keys(self) -> Keys:
        return keys_for(self.prefix, self.redis_cluster, self.stream_shards)

    @property
    def replication(self) -> Replication:
        return Replication(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    @property
    def ttls(self) -> Ttls:
        return Ttls(job_s=self.job_ttl_s, events_s=self.events_ttl_s)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> GatewaySettings:
        """Read ``FERRY_<FIELD>`` variables (``FERRY_API_KEYS`` and
        ``FERRY_ALLOWED_ORIGINS`` are comma-separated);
        keyword overrides win. Invalid values raise a ValidationError naming the field."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(f"FERRY_{name.upper()}")
            if raw is None:
                continue
            if name == "api_keys":
                values[name] = _api_keys(raw)
            elif name in _LIST_FIELDS:
                values[name] = tuple(k.strip() for k in raw.split(",") if k.strip())
            elif raw.strip().lower() in _NONE_WORDS and _optional(name):
                values[name] = None
            else:
                values[name] = raw
        values.update(overrides)
        return cls.model_validate(values)


def checked_settings(command: str, **overrides: Any) -> GatewaySettings:
    """``ferry gateway``'s and ``ferry batcher``'s settings: ``from_env`` with the tenants
    checked too (``gateway.tenancy.tenants``). A bad value (a blank API key, a tenant's
    weight out of range) exits with the message naming the field, before anything runs."""
    try:
        settings = GatewaySettings.from_env(**overrides)
        tenant_directory(settings)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise SystemExit(f"{command}: {exc}") from None
    return settings
