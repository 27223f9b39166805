"""OpenAI's usage object for completions and chat, with the prompt tokens the prefix cache
served the caller (``prompt_tokens_details.cached_tokens``: its own partition's hits only,
``protocol/tenants/cache_scope.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def usage_body(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` once the worker said how
    many prompt tokens the prefix cache served (the caller's own partition's)."""
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def summed(values: Sequence[int | None]) -> int | None:
    """The sum of the values known; None if none is."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None
