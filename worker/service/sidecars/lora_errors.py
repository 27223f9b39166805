"""Why a LoRA adapter cannot run on this worker, said without where its files are.

A registration that fails to load (``worker/service/sidecars/lora_sync.py``) is remembered as a
``Failure`` with its reason, so its requests are answered at once; the reason of a
``LoraError`` or a path refusal is kept with every path scrubbed out, anything else (a
file that broke the loader some other way) only by its exception's type.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog

from protocol.lora.paths import AdapterPathError, scrub
from worker.engine import LoraError, UnknownAdapter

log = structlog.get_logger("ferry.worker.lora")


@dataclass(frozen=True)
class Failure:
    """One registration that failed to load: which, why (no path) and when."""

    version: str  # the registration (LoraRecord.version)
    reason: str
    at: float  # time.monotonic()


def reason_of(exc: BaseException, path: str | None) -> str:
    """What went wrong, for a log line or a client, without the adapter's path."""
    if not isinstance(exc, (LoraError, AdapterPathError)):
        return f"its files cannot be read ({type(exc).__name__})"
    try:
        real = os.path.realpath(path) if path else None
    except (OSError, ValueError):
        real = None
    return scrub(str(exc), path, real)


def unavailable(model: str, shown: str, reason: str) -> UnknownAdapter:
    """A registered adapter that cannot be read here: the request's clear refusal, under
    the name its caller knows (``shown``) rather than its registry key (``model``)."""
    reason = reason.replace(repr(model), repr(shown))
    log.warning("lora_adapter_unavailable", adapter=shown, error=reason)
    return UnknownAdapter(f"model: LoRA adapter {shown!r} cannot be loaded on this worker: "
                          f"{reason}", "adapter_unavailable")
