"""The prefix cache seen from outside the step: the hashes of cached blocks that left it
for good (prefix affinity's book drops what they held), and the accounting check.

A block leaves the cache for good when no tier holds its hash any more: without a host
tier, a freed cached block taken for other content (``_take_free_block``); with one, a
host slot reused for another block, or an eviction the full tier could not copy; and a
registration a failed step takes back (``forget_step``). A block only moved to the host
tier, or still on the device, is not listed. Off until ``track_evictions`` (the worker
turns it on with prefix affinity): then those places append the hash to ``evicted``, which
costs nothing on a step that evicts nothing, and ``drain_evicted`` hands the list over,
each hash once, leaving out any that came back into a tier since (a recomputed block).
A mixin of ``BlockManager``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections import OrderedDict

    from worker.engine.kv.host_tables import HostTables
    from worker.engine.kv.host_tier import HostTier


class EvictionLog:
    """Reads the ``BlockManager``'s maps; ``evicted`` is shared with its host tier."""

    num_blocks: int
    tier: HostTier | None
    evicted: list[bytes] | None  # None: nobody drains it, so nothing is recorded
    host: HostTables
    _tables: dict[str, list[int]]
    _ref_counts: list[int]
    _free: OrderedDict[int, None]
    _block_of: dict[bytes, int]
    _hash_of: dict[int, bytes]

    def track_evictions(self) -> None:
        """Record the hashes that leave the cache for good, from now on, until drained."""
        self.evicted = []
        if self.tier is not None:
            self.tier.evicted = self.evicted

    def drain_evicted(self) -> list[bytes]:
        """The hashes that left the cache for good since the last drain (each once; none
        that a tier holds again now). Empty when not tracking."""
        got = self.evicted
        if not got:
            return []
        self.track_evictions()
        tier = self.tier
        return [h for h in dict.fromkeys(got)
                if h not in self._block_of and (tier is None or h not in tier)]

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (used by tests)."""
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block twice in one table"
            for block in table:
                holders[block] += 1
        assert holders == self._ref_counts, "reference counts differ from the tables"
        free = {b for b, n in enumerate(holders) if n == 0}
        assert free == set(self._free), "blocks leaked or double-freed"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
        assert len(self._block_of) == len(self._hash_of), "hash maps disagree"
        self.host.check(self._tables)
