"""The device-side block tables: rows written once, then only what changed."""

from __future__ import annotations

import pytest
import torch

from worker.engine.kv.block_manager import BlockManager
from worker.engine.runner import step_inputs
from worker.engine.runner.step_inputs import BlockTableBuffer


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Entries written per scatter (each one copy of [rows, cols, values] to the device)."""
    written: list[int] = []
    inner = step_inputs.host_to_device

    def copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        written.append(tensor.shape[1])
        return inner(tensor, device)

    monkeypatch.setattr(step_inputs, "host_to_device", copy)
    return written


def _gather(buf: BlockTableBuffer, bm: BlockManager, *rids: str) -> torch.Tensor:
    buf.sync(bm.host)
    rows = [bm.host.row_of(rid) for rid in rids]
    return buf.gather(torch.tensor(rows, dtype=torch.long))


def test_rows_follow_the_tables_and_only_appends_are_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    buf = BlockTableBuffer(rows=4, max_blocks_per_seq=8, device=torch.device("cpu"))
    written = _spy(monkeypatch)
    bm.allocate_slots("a", 6)
    bm.allocate_slots("b", 1)
    got = _gather(buf, bm, "a", "b")
    a, b = bm.block_table("a"), bm.block_table("b")
    assert got.shape == (2, 8) and got[0, :3].tolist() == a and got[1, :1].tolist() == b
    assert written == [4]
    bm.allocate_slots("a", 7)  # a decode step crossed a block boundary; b did not
    got = _gather(buf, bm, "b", "a")  # any batch order
    assert got[1, :4].tolist() == bm.block_table("a") and got[0, 0] == b[0]
    assert written == [4, 1]
    _gather(buf, bm, "a", "b")
    assert written == [4, 1]  # nothing changed: nothing written


def test_a_freed_row_is_reused_and_rewritten_from_its_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bm = BlockManager(num_blocks=8, block_size=1)
    buf = BlockTableBuffer(rows=2, max_blocks_per_seq=4, device=torch.device("cpu"))
    written = _spy(monkeypatch)
    bm.allocate_slots("a", 2)
    bm.allocate_slots("b", 1)
    _gather(buf, bm, "a", "b")
    row_b = bm.host.row_of("b")
    bm.free("b")  # b finished (or was preempted): its row goes back
    bm.allocate_slots("c", 3)
    assert bm.host.row_of("c") == row_b  # c takes b's row...
    assert _gather(buf, bm, "c")[0, :3].tolist() == bm.block_table("c")  # ...all of it
    assert written == [3, 3]
    bm.allocate_slots("d", 1)  # more holders than rows: grows (eager mode only)
    assert _gather(buf, bm, "d")[0, 0] == bm.block_table("d")[0]
    assert buf.rows == 4


def test_a_table_longer_than_the_context_is_refused_and_the_others_are_kept() -> None:
    bm = BlockManager(num_blocks=8, block_size=1)
    buf = BlockTableBuffer(rows=2, max_blocks_per_seq=2, device=torch.device("cpu"))
    bm.allocate_slots("a", 3)
    bm.allocate_slots("b", 2)
    with pytest.raises(ValueError, match="more than"):
        buf.sync(bm.host)
    row = bm.host.row_of("b")
    assert buf.table[row].tolist() == bm.block_table("b")
