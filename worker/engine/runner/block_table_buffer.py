"""Block tables kept on the device, updated by the entries that changed.

Rebuilding every request's block table from Python lists each step costs O(batch x
blocks) host work and a transfer of the same size; at a batch of 256 requests with 800
tokens of context that is ~13k ints per step for tables that gained at most one entry per
request. Here the device holds one persistent tensor ``[rows, max_blocks_per_seq]`` whose
rows are the block manager's host rows (``host_tables.py``: a request keeps its row while
it holds blocks). A step writes only the entries the host marked dirty since the last
step — a new row (admission, or a table rebuilt after preemption) or the entries appended
— with one scatter, then gathers the step's rows in batch order (on the device). Host
work is O(entries changed) plus array indexing, and the tensor's address never changes,
which CUDA graph replay needs.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.engine.kv.host_tables import HostTables
from worker.engine.runner.transfer import host_to_device


class BlockTableBuffer:
    def __init__(self, rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.table = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32, device=device)

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def sync(self, host: HostTables) -> None:
        """Write the entries ``host`` changed since the last call (one scatter)."""
        dirty = host.take_dirty()
        if not dirty:
            return
        rows = np.fromiter(dirty.keys(), dtype=np.int64, count=len(dirty))
        starts = np.fromiter(dirty.values(), dtype=np.int64, count=len(dirty))
        ends = host.length[rows]
        too_long = ends > self.max_blocks
        if too_long.any():  # the others are still written: they are valid
            longest = int(ends.max())
            self._write(host, rows[~too_long], starts[~too_long], ends[~too_long])
            raise ValueError(f"a block table has {longest} blocks, more than "
                             f"the {self.max_blocks} a sequence may hold")
        self._write(host, rows, starts, ends)

    def _write(self, host: HostTables, rows: np.ndarray, starts: np.ndarray,
               ends: np.ndarray) -> None:
        counts = ends - starts
        keep = counts > 0
        rows, starts, counts = rows[keep], starts[keep], counts[keep]
        if not len(rows):
            return
        while int(rows.max()) >= self.rows:  # more holders than expected: grow (eager only)
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        r = np.repeat(rows, counts)  # [U]
        c = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - starts,
                                                     counts)
        idx = host_to_device(torch.from_numpy(
            np.stack([r, c, host.table[r, c].astype(np.int64)])), self.device)  # [3, U]
        self.table.index_put_((idx[0], idx[1]), idx[2].to(torch.int32))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The tables of ``rows`` (on the device), ``[len(rows), max_blocks_per_seq]`` int32."""
        return self.table.index_select(0, rows)
