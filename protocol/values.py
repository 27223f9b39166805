"""Checks on JSON-like values (maps, lists, leaves) that every producer's input goes
through: where is the first bad leaf or key, and what counts as bad on the wire.

Torch-free and dependency-free, so ``protocol.structured.constraint`` and ``protocol.models`` both
use it without importing each other.
"""

from __future__ import annotations

from typing import Any


def first_path(value: object, bad: Any, path: str = "") -> str | None:
    """Dotted path of the first leaf or map key (in maps and lists) for which ``bad``
    holds. Keys count: a JSON schema's property name is as much text as any value."""
    if isinstance(value, dict | list):
        items: Any = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            label = str(key).encode("utf-8", "backslashreplace").decode()  # printable
            where = f"{path}.{label}" if path else label
            if isinstance(value, dict) and bad(key):
                return f"{where} (a key)"
            found = first_path(item, bad, where)
            if found:
                return found
        return None
    return (path or "(value)") if bad(value) else None


def out_of_int64(value: object) -> bool:
    """An integer msgpack cannot carry (outside int64/uint64)."""
    return isinstance(value, int) and not isinstance(value, bool) \
        and not -(2**63) <= value < 2**64


def unencodable(value: object) -> bool:
    """A string that is not valid Unicode text (a lone surrogate, which JSON's ``\\ud800``
    escape can produce): msgpack and UTF-8 cannot carry it."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
