"""Which running request holds which adapter slot: the scheduler's side of multi-LoRA.

A request pins its adapter's device slot from the step it is admitted until it finishes
or is preempted, so a waiting request never holds a slot another could use. When every
slot is pinned by running rows of other adapters (``LoraSlotsFull``), the request stays
waiting and the scheduler tries the next one: it is admitted once a slot frees. The
request carries its adapter's host weights (``Request.lora``), taken when it was added,
so an adapter unloaded meanwhile still serves the requests that were already accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.lora.slots import LoraSlotsFull

if TYPE_CHECKING:
    from worker.engine.lora.manager import LoraManager
    from worker.engine.request import Request


class AdapterGate:
    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager

    def admit(self, request: Request) -> bool:
        """Pin the request's adapter (True, also when it has none), or False when no
        slot can take it now."""
        if request.lora is None:
            return True
        try:
            self.manager.attach_adapter(request.request_id, request.lora)
        except LoraSlotsFull:
            return False
        return True

    def release(self, request: Request) -> None:
        """Unpin (finished, aborted or preempted); nothing when it held no slot."""
        if request.lora is not None:
            self.manager.detach(request.request_id)
