"""What the model runner holds for multi-LoRA: adapters, slots, requests' pins, the step.

``LoraManager`` wraps the model's projections once, owns the registered adapters (host
cache), the device slots and the one ``LoraStep`` the projections read; the engine tells
it which adapter each request uses (``attach`` pins a slot for as long as the request
runs, ``detach`` unpins), and the runner calls ``begin_step`` with the step's rows before
each forward and ``end_step`` after it.

On a tensor-parallel worker rank 0's manager journals its slot writes and hands each
step's adapters to its followers (``sync_followers``); a follower's manager registers
nothing and replays them (``follow``, ``tp_sync.py``).

A name installed again (new weights) is a new version beside the old one: requests added
from then on run the new version, the ones already running keep the old one's slot, and
that slot is freed when the last of them detaches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from worker.engine.lora.adapter import LoraAdapter, LoraError
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.host_cache import AdapterCache
from worker.engine.lora.layer import wrap_projections
from worker.engine.lora.metadata import LoraMetadata, LoraStep, build_metadata
from worker.engine.lora.slots import LoraSlots, slot_key
from worker.engine.lora.targets import base_targets
from worker.engine.lora.tp_sync import LoraStepSync, apply_sync, take_sync


class LoraManager:
    def __init__(self, model: nn.Module, model_name: str, cfg: LoraConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        targets = base_targets(model, model_name)
        self.cfg = cfg
        self.device = device
        self.cache = AdapterCache(targets, cfg)
        self.slots = LoraSlots(targets, cfg, device, dtype)
        self.step = LoraStep()
        self.wrapped = wrap_projections(model, self.slots, self.step)
        # the directories runtime loads may read (protocol/lora/paths.py); the service sets
        # them from its settings (LoraSync), the offline API loads what it is given
        self.roots: tuple[str, ...] = ()
        self._adapter_of: dict[str, str] = {}  # request id -> its version (slot_key)
        self._slot_of: dict[str, int] = {}  # request id -> its pinned slot
        self._token_slots: np.ndarray | None = None  # the step's map (followers')

    def lead_followers(self) -> None:
        """Rank 0 of a tensor-parallel group: journal slot writes from now on."""
        self.slots.journal = []

    def sync_followers(self) -> LoraStepSync | None:
        """Rank 0: what its followers need before this step (after ``begin_step``); None
        when nothing (no slot written, no row on an adapter: their metadata stays None)."""
        sync = take_sync(self.slots, self._token_slots)
        return sync if sync.writes or sync.token_slots is not None else None

    def follow(self, sync: LoraStepSync) -> None:
        """A follower rank: rank 0's slot writes, and the step's metadata it runs next."""
        self.step.meta = apply_sync(self.slots, sync)

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Register ``name``; a bad adapter raises ``LoraError`` and changes nothing. A
        name already registered is refused (``install`` replaces one)."""
        if name in self.cache.paths:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        return self.cache.register(name, path)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter, registering nothing (safe off the engine loop: the
        slow part of ``add_adapter``, for a sync thread or a load check)."""
        return self.cache.load(name, path)

    def install(self, adapter: LoraAdapter, registration: str = "") -> LoraAdapter:
        """Register what ``load`` returned (the engine loop; cheap): a new version of its
        name, which new requests get at once; an older version's running rows keep its
        slot until they finish."""
        previous = self.cache.keys.get(adapter.name)
        installed = self.cache.install(adapter, registration)
        if previous is not None:
            self.slots.evict(previous)  # now, unless rows still run on it
        return installed

    def adapter(self, name: str) -> LoraAdapter:
        """The registered adapter ``name`` (its host weights); ``KeyError`` if unknown."""
        return self.cache.get(name)

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``: new requests cannot attach it; rows already running keep
        their slot until they detach (then the slot is the first reused)."""
        key = self.cache.keys.get(name)
        self.cache.unregister(name)
        if key is not None:
            self.slots.evict(key)

    def adapters(self) -> list[str]:
        return sorted(self.cache.paths)

    def attach(self, request_id: str, name: str) -> int:
        """Pin ``name`` into a slot for ``request_id``; raises ``KeyError`` for an
        unregistered name and ``LoraSlotsFull`` when every slot has running rows."""
        return self.attach_adapter(request_id, self.cache.get(name))

    def attach_adapter(self, request_id: str, adapter: LoraAdapter) -> int:
        """``attach`` for weights already in hand (the request's own, see gate.py)."""
        if request_id in self._adapter_of:
            raise RuntimeError(f"request {request_id!r} already has a LoRA adapter")
        slot = self.slots.acquire(adapter)
        self._adapter_of[request_id] = slot_key(adapter)
        self._slot_of[request_id] = slot
        return slot

    def detach(self, request_id: str) -> None:
        """The request finished (or was preempted): unpin its adapter's slot; a version
        unloaded or replaced while it ran leaves its slot with its last row."""
        key = self._adapter_of.pop(request_id, None)
        if key is None:
            return
        del self._slot_of[request_id]
        self.slots.release(key)
        if not self.cache.is_current(key):
            self.slots.evict(key)

    def row_slots(self, request_ids: Sequence[str]) -> np.ndarray:
        """Each request's pinned slot (-1: the base model), for a one-token-per-row step."""
        return np.fromiter((self._slot_of.get(r, -1) for r in request_ids), dtype=np.int64,
                           count=len(request_ids))

    def graph_metadata(self, token_slots: torch.Tensor) -> LoraMetadata:
        """Metadata over a static device buffer of slots (the decode graphs'): device ops
        only, so a CUDA graph records them and a replay re-sorts whatever the buffer holds;
        the kernels' grid depends on the buffer's length and the slot count alone."""
        from kernels.lora import lora_segments

        sorted_tokens, starts = lora_segments(token_slots, len(self.slots.ranks))
        return LoraMetadata(token_slots, None, list(self.slots.ranks),
                            sorted_tokens=sorted_tokens, starts=starts)

    def begin_step(self, request_ids: Sequence[str], num_new: Sequence[int] | np.ndarray
                   ) -> None:
        """Set the step's metadata: request ``i`` contributes ``num_new[i]`` flat tokens,
        in order; a request with no adapter gets slot -1."""
        self._token_slots = None
        if not self._slot_of:
            self.step.meta = None
            return
        rows = self.row_slots(request_ids)
        token_slots = np.repeat(rows, np.asarray(num_new, dtype=np.int64))
        self._token_slots = token_slots
        slots = self.slots
        self.step.meta = build_metadata(token_slots, slots.ranks, slots.scales,
                                        slots.max_rank, self.device)

    def end_step(self) -> None:
        self.step.meta = None
