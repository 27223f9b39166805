"""Gateway configuration: one frozen model, built in code or from ``FERRY_*`` variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.keys import Keys
from protocol.store import Ttls

_NONE_WORDS = frozenset({"", "none", "off", "null"})


def _optional(name: str) -> bool:
    """Whether a ``GatewaySettings`` field accepts None (then ``none``/``off`` set it)."""
    return type(None) in getattr(GatewaySettings.model_fields[name].annotation, "__args__", ())


class GatewaySettings(BaseModel):
    """Every knob of the gateway; each field ``x`` can be set by ``FERRY_X`` in the env."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str = "redis://localhost:6379/0"
    prefix: str = "ferry"
    api_keys: tuple[str, ...] = Field(default=(), description="Empty: no authentication.")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_prompt_chars: int = Field(default=400_000, ge=1, description="prompt or all messages.")
    max_prompt_tokens: int = Field(default=32_768, ge=1, description="prompt_token_ids length.")
    max_tokens_limit: int = Field(default=8192, ge=1, description="Cap on max_tokens.")
    default_max_tokens: int = Field(default=256, ge=1, description="Chat default if unset.")
    max_n: int = Field(default=16, ge=1, le=128, description="Cap on n and best_of.")
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
    served_model_name: str | None = Field(
        default=None, max_length=256,
        description="The model name this gateway answers to (besides the names live workers "
        "advertise); requests naming another model get 404.",
    )

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    @property
    def ttls(self) -> Ttls:
        return Ttls(job_s=self.job_ttl_s, events_s=self.events_ttl_s)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> GatewaySettings:
        """Read ``FERRY_<FIELD>`` variables (``FERRY_API_KEYS`` is comma-separated);
        keyword overrides win. Invalid values raise a ValidationError naming the field."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(f"FERRY_{name.upper()}")
            if raw is None:
                continue
            if name == "api_keys":
                values[name] = tuple(k.strip() for k in raw.split(",") if k.strip())
            elif raw.strip().lower() in _NONE_WORDS and _optional(name):
                values[name] = None
            else:
                values[name] = raw
        values.update(overrides)
        return cls.model_validate(values)
