"""The prefix-cache registrations a step made, and how a failed step takes them back.

A block is registered under its hash when it is allocated (``cache_full_blocks``), before
the forward that computes it; if that forward fails, or the request is preempted before it
runs, ``forget_step`` unregisters it (and tells the host tier to drop any copy), so no block
is ever cached with contents that were not computed (and, when tracked, the hash is listed
as gone: ``block_evictions.py``). A mixin of ``BlockManager``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.kv.host_tables import HostTables
    from worker.engine.kv.host_tier import HostTier


class StepRegistrations:
    """Reads and writes the ``BlockManager``'s maps; ``_step`` and ``_prev_step`` hold
    (request id, block, hash) of this step's and the previous step's registrations."""

    _step: list[tuple[str, int, bytes]]
    _prev_step: list[tuple[str, int, bytes]]
    _block_of: dict[bytes, int]
    _hash_of: dict[int, bytes]
    _tables: dict[str, list[int]]
    _ref_counts: list[int]
    host: HostTables
    tier: HostTier | None
    evicted: list[bytes] | None

    def begin_step(self) -> None:
        # the previous step may still be running (overlapped steps): a failure read back
        # from it must be able to undo its registrations too
        self._prev_step, self._step = self._step, []

    def forget_step(self, request_id: str | None = None) -> None:
        """Unregister this step's registrations (of one request), or those of this step
        and the one before (all): their blocks will not be computed after all (a failed
        forward, a request preempted before running)."""
        if request_id is None:
            self._forget(self._prev_step)
            self._prev_step = []
        kept = [r for r in self._step if request_id is not None and r[0] != request_id]
        self._forget([r for r in self._step if request_id is None or r[0] == request_id])
        self._step = kept

    def _forget(self, registrations: list[tuple[str, int, bytes]]) -> None:
        for rid, block, h in registrations:
            if self.tier is not None:  # a copy may have been taken of it: not computed
                self.tier.forget(h)
            if self._block_of.get(h) == block:
                del self._block_of[h]
                del self._hash_of[block]
            if self.evicted is not None:  # the drain leaves it out if cached after all
                self.evicted.append(h)
            table = self._tables.get(rid, [])
            row = self.host.row_of(rid)
            if row is not None and block in table:
                self.host.registered[row] = min(int(self.host.registered[row]),
                                                table.index(block))

    def provides_this_step(self, request_id: str) -> bool:
        """Whether another request holds a block this one registers this step (so this one
        must compute it: it cannot be preempted before the forward)."""
        return any(rid == request_id and self._ref_counts[block] > 1
                   for rid, block, _ in self._step)
