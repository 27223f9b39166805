"""Paged KV-cache bookkeeping in pure Python: free list, reference counts, block tables.

The model runner owns the KV tensors; this class only decides which block ids each
request may write to. Running out of blocks is a normal answer (``None``) that the
scheduler turns into waiting or preemption — never an exception.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks held back when admitting *new* requests, so running ones can still grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, total_tokens: int) -> int:
        held = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_needed(total_tokens) - held)

    # -- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, total_tokens: int, *, admitting: bool = False
    ) -> list[int] | None:
        """Grow the request's table to hold ``total_tokens`` tokens.

        Returns the newly added block ids, or ``None`` (nothing changed) when the free
        list cannot cover them — keeping the watermark in reserve when ``admitting``.
        """
        need = self.num_new_blocks(request_id, total_tokens)
        reserve = self.watermark_blocks if admitting else 0
        if need > len(self._free) - reserve:
            return None
        table = self._tables.setdefault(request_id, [])
        new_blocks = [self._free.popleft() for _ in range(need)]
        for block in new_blocks:
            self._ref_counts[block] += 1
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Release every block the request holds (a no-op for unknown ids)."""
        table = self._tables.pop(request_id, None)
        if not table:
            return
        # Tail blocks first, so the least useful blocks are reused first.
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (used by tests)."""
        held = sum(len(t) for t in self._tables.values())
        assert held + len(self._free) == self.num_blocks, "blocks leaked or double-freed"
        assert len(set(self._free)) == len(self._free), "duplicate block in free list"
        for block in self._free:
            assert self._ref_counts[block] == 0, f"free block {block} still referenced"
