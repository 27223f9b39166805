"""The device-side block tables: rows written once, then only what changed."""

from __future__ import annotations

import pytest
import torch

from worker.engine.block_table_buffer import BlockTableBuffer


def _spy(buf: BlockTableBuffer) -> list[int]:
    written: list[int] = []
    inner = buf._scatter

    def scatter(rows: list[int], cols: list[int], vals: list[int]) -> None:
        written.append(len(vals))
        inner(rows, cols, vals)

    buf._scatter = scatter  # type: ignore[method-assign]
    return written


def test_rows_follow_the_tables_and_only_appends_are_written() -> None:
    buf = BlockTableBuffer(rows=4, max_blocks_per_seq=8, device=torch.device("cpu"))
    written = _spy(buf)
    a, b = [3, 4, 5], [7]
    got = buf.gather([("a", a), ("b", b)])
    assert got.shape == (2, 8) and got[0, :3].tolist() == a and got[1, :1].tolist() == b
    assert written == [4]
    a.append(9)  # a decode step crossed a block boundary; b did not
    got = buf.gather([("b", b), ("a", a)])  # any batch order
    assert got[1, :4].tolist() == a and got[0, 0] == 7
    assert written == [4, 1]
    buf.gather([("a", a), ("b", b)])
    assert written == [4, 1]  # nothing changed: nothing written


def test_a_replaced_table_is_rewritten_and_released_rows_are_reused() -> None:
    buf = BlockTableBuffer(rows=2, max_blocks_per_seq=4, device=torch.device("cpu"))
    written = _spy(buf)
    buf.gather([("a", [1, 2]), ("b", [3])])
    again = [8]  # preempted and reallocated: the block manager's list is a new one
    assert buf.gather([("a", again)])[0, 0] == 8  # entries past the table are never read
    assert written == [3, 1]
    buf.release_missing({"a": again})  # b finished
    assert buf.gather([("c", [5, 6])])[0, :2].tolist() == [5, 6]  # c takes b's row
    assert buf.rows == 2
    buf.gather([("d", [1])])  # more holders than rows: grows (eager mode only)
    assert buf.rows == 4


def test_a_table_longer_than_the_context_is_refused() -> None:
    buf = BlockTableBuffer(rows=1, max_blocks_per_seq=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="more than"):
        buf.gather([("a", [1, 2, 3])])
