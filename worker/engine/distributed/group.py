"""The tensor-parallel process group on torch.distributed: NCCL on CUDA, gloo on CPU.

Every collective of the forward carries the group's timeout, so a rank that dies or hangs
turns into an error on the others within a bounded time instead of a worker stuck
forever. The step broadcast has a gloo group of its own whose wait is long: a follower
waits there for as long as rank 0 has nothing to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker.engine.distributed.tp_config import TPConfig


@dataclass(frozen=True)
class GroupSpec:
    """How the ranks of one worker meet: a rendezvous address and a collective timeout."""

    init_method: str  # e.g. "tcp://127.0.0.1:29517" or "file:///tmp/ferry-tp"
    timeout_s: float = 30.0


def backend_for(device_type: str) -> str:
    """NCCL for CUDA tensors, gloo for everything else."""
    return "nccl" if device_type == "cuda" else "gloo"


# The step broadcasts' own gloo group: a follower waits on it for as long as rank 0 is
# idle, so its timeout is long; a follower that dies is seen on it at once (a closed
# connection), one that hangs by the next collective of the main group.
_CONTROL: list[Any] = []
_IDLE_WAIT = timedelta(days=365)
# The forward's collectives run on a group with the spec's timeout; the default group
# (the rendezvous, where a rank may take minutes to import and start) waits longer.
_FORWARD: list[Any] = []
_START_WAIT_S = 600.0


def _forward_group() -> Any:
    return _FORWARD[0] if _FORWARD else None


def init_group(tp: TPConfig, spec: GroupSpec, device_type: str) -> None:
    """Join this process to the worker's tensor-parallel group (a no-op at size 1)."""
    if not tp.enabled:
        return
    dist.init_process_group(
        backend=backend_for(device_type), init_method=spec.init_method,
        world_size=tp.size, rank=tp.rank,
        timeout=timedelta(seconds=max(spec.timeout_s, _START_WAIT_S)))
    _FORWARD[:] = [dist.new_group(backend=backend_for(device_type),
                                  timeout=timedelta(seconds=spec.timeout_s))]
    _CONTROL[:] = [dist.new_group(backend="gloo", timeout=_IDLE_WAIT)]


def close_group() -> None:
    """Leave the group, if this process joined one."""
    _CONTROL.clear()
    _FORWARD.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (the row-parallel layers' one reduction)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_forward_group())
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise largest ``x`` over the ranks, in place (a scale over a cut row)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_forward_group())
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's equal-shaped ``x`` along the last dimension, rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous(), group=_forward_group())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank (how rank 0 hands its step to the others)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CONTROL[0] if _CONTROL else None)
    return box[0]


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        box = box.cuda()
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_forward_group())
    return int(box.item())
