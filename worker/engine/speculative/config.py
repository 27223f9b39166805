"""Speculative decoding settings (suffix decoding): ``EngineConfig.speculative``,
``FERRY_SPECULATIVE`` / ``FERRY_NUM_SPECULATIVE_TOKENS`` / ``FERRY_SPEC_MAX_BATCH`` /
``FERRY_SPEC_STORE_TOKENS`` / ``FERRY_SPEC_STORE_TTL_S``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

SpeculativeMethod = Literal["off", "suffix"]

DEFAULT_STORE_TTL_S = 6 * 3600.0
"""How long a stored text may be drafted from (data retention: docs/engine.md)."""
MAX_STORE_TTL_S = 30 * 86400.0
"""The longest retention accepted: the store never keeps anything for good."""


def store_ttl_setting(raw: str | None) -> float | None:
    """``FERRY_SPEC_STORE_TTL_S`` as seconds (None: unset, the default); ValueError naming
    the variable for anything but a number from 0 to ``MAX_STORE_TTL_S``."""
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FERRY_SPEC_STORE_TTL_S must be a number of seconds, got {raw!r}"
                         ) from None
    check_store_ttl(value)
    return value


def check_store_ttl(value: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= MAX_STORE_TTL_S):
        raise ValueError(f"store_ttl_s (FERRY_SPEC_STORE_TTL_S) must be from 0 to "
                         f"{MAX_STORE_TTL_S:.0f} seconds, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed; ``off`` proposes none."""

    method: SpeculativeMethod = "off"
    # Most tokens drafted for one row in one step.
    num_speculative_tokens: int = 32
    # A match shorter than this drafts nothing (a weak match is mostly rejected).
    min_match_tokens: int = 2
    # Draft length grows with the match: at most ``draft_per_matched`` per matched token.
    draft_per_matched: float = 1.0
    # Store of recent outputs, per tenant (worker-local; fed by the fleet's stream when it
    # is on): at most this many tokens over all tenants...
    store_tokens: int = 262_144
    # ...each text for at most this many seconds, here and in the fleet's stream (0: the
    # store keeps nothing and nothing is shared).
    store_ttl_s: float = DEFAULT_STORE_TTL_S
    # How many of a finished request's prompt tokens are stored before its output.
    stored_prompt_tail: int = 64
    # Context tokens a store query walks (the longest match it can find).
    match_window: int = 32
    # Back-off (``backoff.py``): costs in decode rows (fitted on CPU, default model, the
    # vectorised kernel and the lean path: docs/engine.md): a step's fixed part, one draft
    # token's verification, a step carrying drafts.
    overhead_rows: float = 20.0
    draft_token_cost: float = 0.55
    draft_step_cost: float = 3.0
    # Hard cap: no drafts at all while more rows than this run.
    max_batch_rows: int = 256

    def __post_init__(self) -> None:
        if self.method not in ("off", "suffix"):
            raise ValueError(f"speculative method must be 'suffix' or 'off', got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in 1..64, got "
                             f"{self.num_speculative_tokens}")
        if self.min_match_tokens < 1 or self.draft_per_matched <= 0:
            raise ValueError("min_match_tokens must be >= 1 and draft_per_matched > 0")
        if self.max_batch_rows < 1 or self.overhead_rows <= 0 or self.draft_token_cost <= 0 \
                or self.draft_step_cost < 0:
            raise ValueError("max_batch_rows must be >= 1, overhead_rows and "
                             "draft_token_cost > 0, draft_step_cost >= 0")
        if self.store_tokens < 0 or self.stored_prompt_tail < 0 or self.match_window < 1:
            raise ValueError("store_tokens and stored_prompt_tail must be >= 0, "
                             "match_window >= 1")
        check_store_ttl(self.store_ttl_s)

    @property
    def costs(self) -> tuple[float, float, float]:
        return self.overhead_rows, self.draft_token_cost, self.draft_step_cost

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def keeps_outputs(self) -> bool:
        """Whether finished texts are stored (and shared with the fleet) at all."""
        return self.enabled and self.store_tokens > 0 and self.store_ttl_s > 0
