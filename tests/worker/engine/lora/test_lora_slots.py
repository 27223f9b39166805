"""Device slots: LRU reuse, pinned slots never evicted, unload while rows run; metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine.distributed.sharding import ShardCut
from worker.engine.lora.adapter import LoraAdapter
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.metadata import build_metadata, cpu_groups
from worker.engine.lora.slots import LoraSlots, LoraSlotsFull
from worker.engine.lora.targets import BaseTargets, TargetShape
from worker.engine.lora.tp_sync import apply_sync, take_sync

BASE = BaseTargets("m", {"l.0.q_proj": TargetShape(6, 4), "l.0.up_proj": TargetShape(6, 8)})


def _adapter(name: str, rank: int = 2, only_q: bool = False) -> LoraAdapter:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    weights = {m: (torch.randn(rank, s.in_features, generator=g),
                   torch.randn(s.out_features, rank, generator=g))
               for m, s in BASE.shapes.items() if not only_q or m.endswith("q_proj")}
    return LoraAdapter(name, "/x", rank, 0.5, weights)


def _slots(n: int = 2) -> LoraSlots:
    return LoraSlots(BASE, LoraConfig(max_loras=n, max_lora_rank=4, max_cpu_loras=n),
                     torch.device("cpu"), torch.float32)


def test_write_pads_rank_and_zeroes_untargeted() -> None:
    slots = _slots()
    full, q_only = _adapter("full"), _adapter("q", rank=3, only_q=True)
    assert slots.acquire(full) == 0
    slots.release("full")
    assert slots.acquire(q_only) == 1
    slots.release("q")
    assert slots.acquire(_adapter("third")) == 0  # LRU: "full" was used least recently
    slots.release("third")
    assert slots.slot_of("full") is None
    assert slots.acquire(full) == 1  # now "q" is least recent
    assert torch.equal(slots.a["l.0.q_proj"][1, :2], full.weights["l.0.q_proj"][0])
    assert not slots.a["l.0.q_proj"][1, 2:].any()  # the rank-3 adapter's row is gone
    assert slots.ranks[1] == 2 and slots.scale[1] == 0.5


def test_pinned_slots_are_never_evicted() -> None:
    slots = _slots()
    slots.acquire(_adapter("a"))
    slots.acquire(_adapter("b"))
    with pytest.raises(LoraSlotsFull):
        slots.acquire(_adapter("c"))
    slots.release("b")
    assert slots.acquire(_adapter("c")) == 1  # "a" is pinned, "b" is not
    assert slots.slot_of("a") == 0 and slots.slot_of("b") is None
    assert not slots.evict("a")  # pinned: its rows finish first
    slots.release("a")
    assert slots.evict("a") and slots.slot_of("a") is None
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release("c") or slots.release("c")


def test_metadata_groups_wide_and_skip() -> None:
    cpu = torch.device("cpu")
    assert build_metadata(np.array([-1, -1]), [2, 2], [1.0, 1.0], 4, cpu) is None
    groups = cpu_groups(np.array([1, 1, -1, 0, 1, 0, 0]))
    assert [g[0] for g in groups] == [0, 1]
    assert groups[0][1].tolist() == [3, 5, 6]  # type: ignore[union-attr]
    assert cpu_groups(np.array([-1, 2, 2, 2]))[0][1] == slice(1, 4)
    meta = build_metadata(np.array([1, -1, 2]), [3, 1, 2], [0.0, 0.5, 2.0], 4, cpu)
    assert meta is not None and meta.token_slots.tolist() == [1, -1, 2]
    assert meta.wide_cols == slice(4, 12)  # slots 1..2 of a rank-4 pool
    assert meta.wide is not None and meta.wide.tolist() == [
        [0.5, 0, 0, 0, 0, 0, 0, 0], [0] * 8, [0, 0, 0, 0, 2.0, 2.0, 0, 0]]  # ranks 1 and 2


def test_b_is_a_view_of_the_flat_storage() -> None:
    slots = _slots()
    adapter = _adapter("a")
    slot = slots.acquire(adapter)
    b = adapter.weights["l.0.up_proj"][1]  # [8, 2]
    flat = slots.b_flat["l.0.up_proj"]  # [8, S*R]
    assert torch.equal(flat[:, slot * 4:slot * 4 + 2], b)
    assert torch.equal(slots.a_flat["l.0.up_proj"][slot * 4:slot * 4 + 2],
                       adapter.weights["l.0.up_proj"][0])


def _rank_slots(rank: int) -> LoraSlots:
    """Rank ``rank`` of 2: q_proj column-parallel (2 of 4 outputs), up_proj row-parallel
    (3 of 6 inputs)."""
    base = BaseTargets("m", BASE.shapes, {
        "l.0.q_proj": ShardCut("out", 2 * rank, 2 * rank + 2, 4),
        "l.0.up_proj": ShardCut("in", 3 * rank, 3 * rank + 3, 6)})
    return LoraSlots(base, LoraConfig(max_loras=2, max_lora_rank=4, max_cpu_loras=2),
                     torch.device("cpu"), torch.float32)


def test_tensor_parallel_shards_add_up_to_the_whole_adapter() -> None:
    """Column cut: the ranks' deltas side by side are the whole delta; row cut: the
    ranks' partial deltas (each from its input shard) sum to it."""
    adapter = _adapter("full")
    ranks = [_rank_slots(r) for r in (0, 1)]
    for slots in ranks:
        assert slots.acquire(adapter) == 0
    x = torch.randn(5, 6, dtype=torch.float64)

    def delta(slots: LoraSlots, module: str, inp: torch.Tensor) -> torch.Tensor:
        a, b = slots.a[module][0, :2].double(), slots.b[module][0, :, :2].double()
        return inp @ a.T @ b.T

    for module in ("l.0.q_proj", "l.0.up_proj"):
        a, b = (w.double() for w in adapter.weights[module])
        whole = x @ a.T @ b.T
        if module.endswith("q_proj"):
            got = torch.cat([delta(s, module, x) for s in ranks], dim=-1)
        else:
            got = sum(delta(s, module, x[:, 3 * r:3 * r + 3]) for r, s in enumerate(ranks))
        torch.testing.assert_close(got, whole)


def test_a_follower_replays_the_leaders_slot_writes() -> None:
    """Rank 0 journals its writes; a follower replaying them holds the same adapters in
    the same slots and builds the same step metadata."""
    lead, follower = _rank_slots(0), _rank_slots(0)
    lead.journal = []
    for name in ("a", "b", "c"):  # two slots: "c" evicts "a"
        slot = lead.acquire(_adapter(name, rank=2 + (name == "b")))
        lead.release(name)
        token_slots = np.array([slot, -1, slot], dtype=np.int64)
        apply_sync(follower, take_sync(lead, token_slots))
        assert follower.names == lead.names and follower.ranks == lead.ranks
        assert follower.scales == lead.scales
        for module in lead.a:
            assert torch.equal(follower.a[module], lead.a[module])
            assert torch.equal(follower.b[module], lead.b[module])
    assert lead.journal == [] and follower.slot_of("a") is None
    assert apply_sync(follower, take_sync(lead, None)) is None
