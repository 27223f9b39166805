"""The dead-letter streams: what a record of an entry no worker can run holds, and how
the streams are bounded (by count, age and payload size), so a flood of bad entries
cannot fill Redis.

A record keeps the reason, the entry's ids (``entry_id``, ``stream``, ``request_id`` when
the payload names one, ``pulled_as`` for an entry the fair pull adopted) and the payload
(``data``; over the size bound only its head and size). ``docs/operations.md`` (*Dead
letters*) says how to read and clear them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from protocol.codec import REQUEST_FIELD
from protocol.keys import Keys
from protocol.store import ack, as_str


@dataclass(frozen=True)
class DeadLetterBounds:
    """How much a dead-letter stream may hold: by count (exact MAXLEN), by age (exact MINID:
    entries older than ``max_age_s`` go at the next dead letter) and by size (a payload over
    ``max_payload_bytes`` is kept as its first bytes, ``data_head``, and its length,
    ``data_bytes``, instead of ``data``). Dead letters are rare, so exact trimming costs
    little; what matters is that a flood of them (a broken producer) cannot fill Redis."""

    max_len: int = 10_000
    max_age_s: float = 7 * 24 * 3600.0
    max_payload_bytes: int = 8192

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"dead_letter_max_len: {self.max_len} must be >= 1")
        if self.max_age_s <= 0:
            raise ValueError(f"dead_letter_max_age_s: {self.max_age_s} must be > 0")
        if self.max_payload_bytes < 0:
            raise ValueError(
                f"dead_letter_max_payload_bytes: {self.max_payload_bytes} must be >= 0")


def dead_letter(
    pipe: Any, keys: Keys, entry_id: str | bytes, fields: dict[Any, Any], reason: str,
    stream: str | None = None, *, request_id: str | None = None,
    bounds: DeadLetterBounds = DeadLetterBounds(), now: float | None = None,
) -> None:
    """Queue moving an entry no worker can run to the dead-letter stream (one for every
    lane of a shard; ``stream`` names where it came from), trimming that stream to
    ``bounds``, then XACK it. ``request_id``: the id the payload names, if one was read."""
    stream = stream or keys.requests
    raw = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD, b""))
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    origin = as_str(fields.get(b"origin", fields.get("origin", b"")))
    # an entry the fair pull adopted is named by the id its producer got from XADD
    entry: dict[str, Any] = {"entry_id": origin or as_str(entry_id), "stream": stream,
                             "reason": reason[:2000]}
    if request_id:
        entry["request_id"] = request_id
    if len(raw) > bounds.max_payload_bytes:  # keep the head and the size, not the whole
        entry["data_head"] = raw[:bounds.max_payload_bytes]
        entry["data_bytes"] = len(raw)
    else:
        entry[REQUEST_FIELD] = raw
    if origin:
        entry["pulled_as"] = as_str(entry_id)
    dead = keys.dead_letter_for(stream)
    oldest_ms = max(0, int(((time.time() if now is None else now) - bounds.max_age_s) * 1000))
    pipe.xadd(dead, entry, maxlen=bounds.max_len, approximate=False)
    pipe.xtrim(dead, minid=f"{oldest_ms}-0", approximate=False)
    ack(pipe, keys, entry_id, stream)
