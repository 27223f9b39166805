"""Block tables as rows of one host array: the row a request keeps while it holds blocks.

The block manager's lists stay the truth; this mirror exists so that a step's inputs
(slot mapping, the device block tables) are built with array indexing over the batch
instead of a Python loop over requests (vLLM v1's ``InputBatch`` keeps its tables the same
way). A request gets a row when the block manager creates its table (admission) and gives
it back when its blocks are freed (finish, preemption), so a running request's row never
changes; the scheduler keeps its per-row counters under the same row numbers
(``batch_rows.py``). ``gen`` counts a row's hand-overs: a step that recorded a row's
``gen`` can tell, later, whether the row still belongs to the request it scheduled.
``dirty`` says which entries changed since the device copy (``runner/step_inputs.py``)
last took them (it takes the map, replacing it with an empty one).
"""

from __future__ import annotations

import heapq

import numpy as np


class HostTables:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)  # [rows, width] block ids
        self.length = np.zeros(rows, dtype=np.int64)  # entries of each row's table
        # leading blocks of each row's table registered in the prefix cache
        self.registered = np.zeros(rows, dtype=np.int64)
        self.gen = np.zeros(rows, dtype=np.int64)  # bumped each time a row is given back
        self.releases = 0  # rows given back so far (unchanged: every gen is unchanged)
        self.dirty: dict[int, int] = {}  # row -> first entry the device has not seen
        self._row_of: dict[str, int] = {}
        self._free = list(range(rows))  # a heap: the lowest free row is reused first

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def assign(self, request_id: str) -> int:
        """A row for a request that starts holding blocks (its table is empty)."""
        if not self._free:
            self._grow_rows()
        row = heapq.heappop(self._free)
        self._row_of[request_id] = row
        self.length[row] = 0
        self.registered[row] = 0
        self.dirty[row] = 0
        return row

    def append(self, row: int, blocks: list[int]) -> None:
        start = int(self.length[row])
        end = start + len(blocks)
        if end > self.table.shape[1]:
            wider = np.zeros((self.rows, max(end, 2 * self.table.shape[1])), dtype=np.int32)
            wider[:, :self.table.shape[1]] = self.table
            self.table = wider
        self.table[row, start:end] = blocks
        self.length[row] = end
        self.dirty[row] = min(self.dirty.get(row, start), start)

    def append_one(self, row: int, block: int) -> None:
        """``append(row, [block])``, for the many decodes that enter a block each step."""
        end = int(self.length[row])
        if end == self.table.shape[1]:
            self.append(row, [block])
            return
        self.table[row, end] = block
        self.length[row] = end + 1
        if row not in self.dirty:
            self.dirty[row] = end

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        self.gen[row] += 1
        self.releases += 1
        self.dirty.pop(row, None)
        heapq.heappush(self._free, row)

    def _grow_rows(self) -> None:
        old = self.rows
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.length = np.concatenate([self.length, np.zeros_like(self.length)])
        self.registered = np.concatenate([self.registered, np.zeros_like(self.registered)])
        self.gen = np.concatenate([self.gen, np.zeros_like(self.gen)])
        self._free = list(range(old, 2 * old))

    def check(self, tables: dict[str, list[int]]) -> None:
        """Raise AssertionError unless the rows mirror ``tables`` (used by tests)."""
        assert set(self._row_of) == set(tables), "rows and tables hold different requests"
        assert len(set(self._row_of.values())) == len(self._row_of), "a row held twice"
        for rid, table in tables.items():
            row = self._row_of[rid]
            assert self.length[row] == len(table), f"{rid}: row length differs"
            assert self.table[row, :len(table)].tolist() == table, f"{rid}: row differs"
            assert 0 <= self.registered[row] <= len(table), f"{rid}: registered"
