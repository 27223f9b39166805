"""The device slots: ``max_loras`` adapters resident at once, stacked per projection.

Why stacked: the kernels take one ``A`` [S, R, in] and one ``B`` [S, out, R] per projection
and a slot index per token, so a step mixing adapters is one launch per projection, and
the buffers never move (a CUDA graph captured over them stays valid when adapters
change). Every slot is padded to ``max_lora_rank``: an adapter of a smaller rank is
written into the top-left corner and the rest is zero, which adds exact zeros.

Slots are recycled least-recently-used first, but a slot with running rows (its pin count
is above zero) is never evicted: when every slot is pinned, ``acquire`` raises
``LoraSlotsFull`` and the request must wait for a slot (the scheduler's job).

A slot holds one *version* of an adapter (``slot_key``: its prefix-cache key, name, path
and registration): a name registered again with new weights gets a slot of its own, so the
old version finishes its running rows while new requests run on the new one at once.

Under tensor parallelism each rank's buffers hold its shard's slice (``BaseTargets.cuts``):
for a column-parallel projection A whole and B's rows of its output features, for a
row-parallel one A's columns of its input features and B whole; ``_write`` cuts the
host adapter that way. Rank 0 keeps a journal of the slots it wrote (``journal``), which
its followers replay in step order (``tp_sync.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from worker.engine.distributed.sharding import ShardCut
from worker.engine.lora.adapter import LoraAdapter, all_finite
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.targets import BaseTargets


class LoraSlotsFull(RuntimeError):
    """Every device slot holds an adapter with running rows."""


def slot_key(adapter: LoraAdapter) -> str:
    """What a slot holds: one registration of an adapter (its prefix-cache key), or its
    name for an adapter that was never registered (tests build such ones)."""
    return adapter.cache_key or adapter.name


class LoraSlots:
    def __init__(self, targets: BaseTargets, cfg: LoraConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        n, r = cfg.max_loras, cfg.max_lora_rank
        self.num_slots, self.max_rank = n, r
        local = {m: targets.local_shape(m) for m in targets.shapes}  # this rank's shards
        self.cuts = targets.cuts
        self.a = {m: torch.zeros(n, r, s.in_features, device=device, dtype=dtype)
                  for m, s in local.items()}  # module -> [S, R, in]
        # B is stored [out, S, R] and handed out as the view [S, out, R] (unit stride on
        # R, as the kernels need): the CPU path multiplies by all slots at once through
        # the flat views [S*R, in] and [out, S*R] (``layer.py``)
        b_store = {m: torch.zeros(s.out_features, n, r, device=device, dtype=dtype)
                   for m, s in local.items()}
        self.b = {m: t.permute(1, 0, 2) for m, t in b_store.items()}  # [S, out, R]
        self.a_flat = {m: t.view(n * r, -1) for m, t in self.a.items()}  # [S*R, in]
        self.b_flat = {m: t.view(t.shape[0], n * r) for m, t in b_store.items()}  # [out, S*R]
        self.scale = torch.zeros(n, device=device, dtype=torch.float32)  # [S]
        self.scales = [0.0] * n  # host copy of ``scale``
        self.ranks = [0] * n  # host copy: the CPU path multiplies only the used rank
        self.names: list[str | None] = [None] * n  # each slot's ``slot_key``
        # whether each slot's rows hold finite numbers only: the CPU's every-slot product
        # reads them for other slots' tokens too (layer.py); on CUDA, where the kernels
        # read a token's own slot alone, they are not checked
        self.finite = [True] * n
        self.pins = [0] * n
        self._recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n))
        self._slot_of: dict[str, int] = {}
        # (slot, adapter) of every write since it was last drained; None: not kept (one
        # process, or a follower rank)
        self.journal: list[tuple[int, LoraAdapter]] | None = None

    def slot_of(self, key: str) -> int | None:
        return self._slot_of.get(key)

    def acquire(self, adapter: LoraAdapter) -> int:
        """The adapter's slot, written there first if it is not resident; pinned once more
        (``release`` undoes one ``acquire``)."""
        slot = self._slot_of.get(slot_key(adapter))
        if slot is None:
            slot = self._victim()
            self._write(slot, adapter)
        self.pins[slot] += 1
        self._recent.move_to_end(slot)
        return slot

    def release(self, key: str) -> None:
        """Unpin one ``acquire`` of the version ``key`` (a ``slot_key``)."""
        slot = self._slot_of.get(key)
        if slot is None or self.pins[slot] == 0:
            raise RuntimeError(f"LoRA adapter {key!r} released more often than acquired")
        self.pins[slot] -= 1

    def pinned(self, key: str) -> bool:
        """Whether version ``key`` is resident with running rows."""
        slot = self._slot_of.get(key)
        return slot is not None and self.pins[slot] > 0

    def evict(self, key: str) -> bool:
        """Forget version ``key``'s slot now if no row uses it (an unloaded or replaced
        adapter); False if it is pinned (its rows finish first) or not resident."""
        slot = self._slot_of.get(key)
        if slot is None or self.pins[slot]:
            return False
        del self._slot_of[key]
        self.names[slot] = None
        self._recent.move_to_end(slot, last=False)  # reused first
        return True

    def _victim(self) -> int:
        """A free slot, else the least recently used one with no pinned rows."""
        for slot in self._recent:
            if self.names[slot] is None:
                return slot
        for slot in self._recent:
            if self.pins[slot] == 0:
                del self._slot_of[self.names[slot]]  # type: ignore[arg-type]
                return slot
        raise LoraSlotsFull(f"all {self.num_slots} LoRA slots hold adapters with running "
                            "rows")

    @torch.inference_mode()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot``; its untargeted projections become zeros. Copies
        are queued on the current stream, after any step still reading the old rows."""
        if self.journal is not None:
            self.journal.append((slot, adapter))
        self.write_at(slot, adapter)

    @torch.inference_mode()
    def write_at(self, slot: int, adapter: LoraAdapter) -> None:
        """``adapter``'s weights (this rank's cut of them) into ``slot``, which then
        holds it: what ``_write`` does, and a follower rank replays."""
        r = adapter.rank
        for module, a_stack in self.a.items():
            b_stack = self.b[module]
            pair = adapter.weights.get(module)
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            if pair is not None:
                a, b = cut_pair(pair, self.cuts.get(module))
                a_stack[slot, :r].copy_(a, non_blocking=True)  # [r, in]
                b_stack[slot, :, :r].copy_(b, non_blocking=True)  # [out, r]
        self.scale[slot] = adapter.scale
        self.scales[slot] = adapter.scale
        self.ranks[slot] = r
        if self.scale.device.type != "cuda":
            self.finite[slot] = all(all_finite(t[slot]) for t in (*self.a.values(),
                                                                   *self.b.values()))
        key, old = slot_key(adapter), self.names[slot]
        if old is not None and self._slot_of.get(old) == slot:  # a follower's replay
            del self._slot_of[old]
        self.names[slot] = key
        self._slot_of[key] = slot


def cut_pair(pair: tuple[torch.Tensor, torch.Tensor], cut: ShardCut | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter's (A [r, in], B [out, r]) cut like its sharded projection: B's rows of
    the shard's output features, or A's columns of its input features."""
    a, b = pair
    if cut is None:
        return a, b
    if cut.axis == "out":
        return a, b[cut.start:cut.end]
    return a[:, cut.start:cut.end], b
