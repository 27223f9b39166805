"""Rank 0 drives ranks 1..N-1: each step's inputs are broadcast, every rank runs the
same forward on its shards, and only rank 0 keeps the logits (it samples).

The followers are spawned by the worker (``torch.multiprocessing``, spawn context); a
follower that dies or hangs surfaces on rank 0 as an error from the next broadcast or
collective within the group's timeout, and the worker exits on it.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from worker.engine.distributed.group import broadcast_object

STOP = None  # the message that ends a follower's loop


def follower_loop(forward: Callable[[Any], Any]) -> int:
    """Run each step rank 0 broadcasts until it says stop; returns the steps run."""
    steps = 0
    while True:
        message = broadcast_object(STOP)
        if message is STOP:
            return steps
        with torch.no_grad():
            forward(message)
        steps += 1


def lead_step(forward: Callable[[Any], Any], message: Any) -> Any:
    """Rank 0: hand ``message`` to the followers, then run the same step here."""
    broadcast_object(message)
    with torch.no_grad():
        return forward(message)


def stop_followers() -> None:
    """Rank 0: end every follower's loop (they then leave the group)."""
    broadcast_object(STOP)


def spawn_followers(size: int, target: Callable[..., None],
                    args: tuple[Any, ...]) -> list[BaseProcess]:
    """Start ranks 1..size-1 as ``target(rank, *args)`` in fresh processes."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=target, args=(rank, *args), name=f"ferry-tp-rank{rank}",
                    daemon=True)  # ended with rank 0 when it exits normally
        for rank in range(1, size)]
    for proc in procs:
        proc.start()
    return procs
