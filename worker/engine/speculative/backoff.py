"""Adaptive back-off for speculative decoding: how many draft tokens a row gets.

Costs in units of one decode row's share of a step: a step of ``B`` decode rows costs
``overhead_rows + B`` (a fixed part: the host's bookkeeping, launches, weights streamed
once), so an accepted draft token, one step of its row saved, is worth
``gain(B) = (overhead_rows + B) / B``. Verifying costs ``token_cost`` per draft token plus
``step_cost`` per step that carries any draft (the ragged path instead of the decode
path), shared by the rows, so about ``step_cost / B`` per row. With acceptance modelled as
geometric (draft token ``j`` accepted with probability ``p ** j``), a row drafts the
longest prefix whose last token still pays (``p ** j * gain >= token_cost``), and nothing
unless the whole draft pays its share of the step too. A retry (``p`` near 1) drafts in
full at batch 16; a weak match drafts little at batch 1 and nothing in a big batch.

``p`` is learnt online, per tenant, draft source and match-length bucket (a longer match
is a stronger hint), from a prior that grows with the match length and evidence that
decays (recent behaviour counts), then blended with the row's own record. Per tenant, so
one tenant's drafts (accepted or rejected) never change how much another's rows draft: no
tenant can slow another's speculation down or read its acceptance from its own timing; the
estimates of at most ``MAX_TENANTS`` tenants are kept (the least recently drafted go back
to the prior). Only the number of draft tokens changes: verification keeps every output
exact whatever is drafted.
"""

from __future__ import annotations

_BUCKETS = 5  # match lengths 2-3, 4-7, 8-15, 16-31, 32+
_PRIOR_WEIGHT = 4.0  # pseudo-observations behind a bucket's prior
_ROW_WEIGHT = 2.0  # pseudo-observations of the bucket's estimate behind a row's record
_DECAY = 0.99  # a bucket's evidence fades per drafted row-step (about 100 remembered)
MAX_TENANTS = 256  # tenants whose estimates are kept


def bucket(match_length: int) -> int:
    """Match-length bucket: powers of two from 2."""
    return max(0, min(_BUCKETS - 1, match_length.bit_length() - 2))


def prior(match_length: int) -> float:
    """Per-token acceptance assumed before any evidence: ``L / (L + 2)`` (0.5 at 2, 0.94
    at 32)."""
    return match_length / (match_length + 2)


def draft_cost(p: float, limit: int, batch_rows: int, costs: tuple[float, float, float]
               ) -> int:
    """Draft tokens worth verifying at acceptance ``p`` and ``batch_rows`` rows; ``costs``
    is (overhead_rows, token_cost, step_cost)."""
    overhead_rows, token_cost, step_cost = costs
    gain = (overhead_rows + batch_rows) / batch_rows
    k, chance, expected = 0, 1.0, 0.0
    while k < limit:
        chance *= p
        if chance * gain < token_cost:
            break
        k += 1
        expected += chance
    if k and expected * gain < step_cost / batch_rows + token_cost * k:
        return 0
    return k


class AcceptanceModel:
    """Per-token acceptance estimates: per (tenant, source, bucket) and per running
    request."""

    def __init__(self, costs: tuple[float, float, float]) -> None:
        self.costs = costs  # (overhead_rows, token_cost, step_cost): see draft_cost
        # tenant -> (source, bucket) -> [accepted tokens, rejections], both decayed; the
        # least recently drafted tenant first
        self._tenants: dict[str, dict[tuple[str, int], list[float]]] = {}
        self._rows: dict[str, list[float]] = {}  # request id -> [accepted, rejections]

    def estimate(self, request_id: str, tenant: str, source: str, match_length: int
                 ) -> float:
        """The chance the next draft token of this row is accepted."""
        table = self._tenants.get(tenant)
        a, r = table.get((source, bucket(match_length)), (0.0, 0.0)) if table else (0.0, 0.0)
        w = _PRIOR_WEIGHT
        p = (a + w * prior(match_length)) / (a + r + w)
        ra, rr = self._rows.get(request_id, (0.0, 0.0))
        return (ra + _ROW_WEIGHT * p) / (ra + rr + _ROW_WEIGHT)

    def draft_length(self, request_id: str, tenant: str, source: str, match_length: int,
                     limit: int, batch_rows: int) -> int:
        """Draft tokens worth verifying for this row at ``batch_rows`` running rows."""
        p = self.estimate(request_id, tenant, source, match_length)
        return draft_cost(p, limit, batch_rows, self.costs)

    def record(self, request_id: str, tenant: str, source: str, match_length: int,
               drafted: int, accepted: int) -> None:
        """A verified draft: ``accepted`` of ``drafted`` tokens (a rejection if fewer)."""
        rejected = 1.0 if accepted < drafted else 0.0
        table = self._tenants.pop(tenant, None)
        if table is None:
            table = {}
            if len(self._tenants) >= MAX_TENANTS:  # the least recently drafted goes
                del self._tenants[next(iter(self._tenants))]
        self._tenants[tenant] = table  # now the most recent
        stats = table.setdefault((source, bucket(match_length)), [0.0, 0.0])
        stats[0] = stats[0] * _DECAY + accepted
        stats[1] = stats[1] * _DECAY + rejected
        row = self._rows.setdefault(request_id, [0.0, 0.0])
        row[0] += accepted
        row[1] += rejected

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
