"""The preference mark a producer puts in front of a request's msgpack on its fair backlog.

``@`` + the time it was marked and the time any worker may take it (milliseconds since the
epoch, 13 digits each) + the preferred worker's id + a newline, then the request. The fair
pull (``protocol.tenants.fair``) reads it: the named worker may take the request at once,
every other worker once the steal time has passed, and the stream entry it becomes carries
the request alone plus ``prefer`` / ``marked`` fields for the worker's metrics. A msgpack
request is a map, whose first byte is never ``@``, so an unmarked item is read as a plain one.
"""

from __future__ import annotations

MARK = b"@"
_STAMP = 13


def mark(worker_id: str, marked_ms: int, steal_ms: int) -> bytes:
    """The mark naming ``worker_id`` (ValueError for an id a mark cannot carry)."""
    if not worker_id or "\n" in worker_id or len(worker_id) > 256:
        raise ValueError(f"worker_id: {worker_id!r} cannot be named in a preference mark")
    if not (0 <= marked_ms <= steal_ms < 10 ** _STAMP):
        raise ValueError("mark: times must be 0 <= marked <= steal, 13 digits")
    return b"%s%013d%013d%s\n" % (MARK, marked_ms, steal_ms, worker_id.encode())


def unmark(payload: bytes) -> tuple[str | None, int, int, bytes]:
    """(preferred worker or None, marked ms, steal ms, the request's msgpack)."""
    if not payload.startswith(MARK):
        return None, 0, 0, payload
    end = payload.index(b"\n", 1 + 2 * _STAMP)
    return (payload[1 + 2 * _STAMP:end].decode(), int(payload[1:1 + _STAMP]),
            int(payload[1 + _STAMP:1 + 2 * _STAMP]), payload[end + 1:])
