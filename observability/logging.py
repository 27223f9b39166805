"""Structured logging for every Ferry process (worker, gateway, launcher).

Why one module: operators grep and ship logs from many workers at once, so every process
must emit the same shape — JSON lines in containers (one object per line, ready for Loki /
CloudWatch / Elasticsearch), readable coloured lines in a terminal — and every line must
carry the ids bound with ``structlog.contextvars.bind_contextvars(request_id=...,
worker_id=...)`` or ``log.bind(...)``. Third-party libraries (uvicorn, redis, transformers)
log through the standard library; their records go through the same renderer so a
container never mixes two formats. Uvicorn must be started with ``log_config=None`` so it
keeps the handlers installed here instead of replacing them.

Prompts are user data: they are never logged unless ``FERRY_LOG_PROMPTS=1``. Call sites
pass prompt text through :func:`redact_prompt`; as a safety net the pipeline also
redacts the values of the keys in :data:`PROMPT_KEYS` on every event.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from structlog.typing import Processor

PROMPT_KEYS = frozenset({"prompt", "prompt_text", "messages"})
"""Event keys whose values are user prompts, redacted unless ``FERRY_LOG_PROMPTS=1``."""

_HANDLER_MARK = "_ferry_handler"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_flag(name: str) -> bool | None:
    """Read a boolean env var; ``None`` when unset or unrecognised (let the caller decide)."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def prompts_allowed() -> bool:
    """Whether prompt text may appear in logs (debugging only; off in production)."""
    return _env_flag("FERRY_LOG_PROMPTS") is True


def redact_prompt(text: Any) -> str:
    """Return ``text`` for a log line: as is with ``FERRY_LOG_PROMPTS=1``, else a length stub.

    The stub keeps the size (useful to spot oversize prompts) without the content.
    Lists (chat messages, token ids) are summarised by their length too.
    """
    if prompts_allowed():
        return text if isinstance(text, str) else repr(text)
    if isinstance(text, str):
        return f"<redacted {len(text)} chars>"
    if isinstance(text, (list, tuple)):
        return f"<redacted {len(text)} items>"
    return "<redacted>"


def _redact_prompt_keys(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Processor: redact prompt-bearing keys a call site forgot to pass through redact_prompt."""
    if prompts_allowed():
        return event
    for key in PROMPT_KEYS.intersection(event):
        value = event[key]
        if not (isinstance(value, str) and value.startswith("<redacted")):
            event[key] = redact_prompt(value)
    return event


def _want_json(json_logs: bool | None) -> bool:
    """Explicit argument, then ``FERRY_LOG_JSON``, then: JSON unless stdout is a terminal."""
    if json_logs is not None:
        return json_logs
    env = _env_flag("FERRY_LOG_JSON")
    if env is not None:
        return env
    isatty = getattr(sys.stdout, "isatty", None)
    return not (isatty is not None and isatty())


def _shared_processors() -> list[Processor]:
    """Steps applied to both structlog events and foreign (stdlib) log records."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _redact_prompt_keys,
        _add_tenant,
    ]


def _add_tenant(_logger: Any, _name: str, event: MutableMapping[str, Any]
                ) -> MutableMapping[str, Any]:
    """Every line about a request names its tenant, read off the (scoped) request id, so a
    tenant's lines are one filter away in any process. The rule is ``protocol.tenants.ids``'s
    (``{tenant}::{id}``; a plain id is the default tenant's), restated here because this
    package sits below every other one."""
    rid = event.get("request_id")
    if isinstance(rid, str) and "tenant" not in event:
        head, sep, _ = rid.partition("::")
        event["tenant"] = head if sep else "default"
    return event


def _renderer(json_logs: bool) -> Processor:
    if json_logs:
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())


def configure_logging(json_logs: bool | None = None, level: str = "info") -> None:
    """Install the Ferry log pipeline; safe to call more than once (the last call wins).

    ``json_logs=None`` picks JSON for containers (stdout not a TTY) or ``FERRY_LOG_JSON=1``.
    ``level`` is a stdlib level name (``debug``, ``info``, ``warning``...).
    """
    as_json = _want_json(json_logs)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level: unknown level {level!r}")
    shared = _shared_processors()
    final: list[Processor] = [structlog.processors.format_exc_info] if as_json else []
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *final,
            _renderer(as_json),
        ],
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    _route_library_loggers()

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: tests and ``ferry up`` may reconfigure after module-level loggers exist.
        cache_logger_on_first_use=False,
    )


def _route_library_loggers() -> None:
    """Make uvicorn's loggers propagate to the root handler instead of printing their own."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lib = logging.getLogger(name)
        lib.handlers.clear()
        lib.propagate = True


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; equivalent to ``structlog.get_logger(name)``, here for one import."""
    return structlog.get_logger(name)
