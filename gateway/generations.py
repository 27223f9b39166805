"""The requests of one HTTP exchange (one per prompt of a prompt list), followed as one.

A completions body with a list of prompts becomes one request per prompt, each with its
own subscription, events and cancel-on-close; OpenAI's response interleaves them (choice
index ``p * n + i``). With one prompt (nearly always) ``next`` is the generation's own; with
several, one small task per generation pumps its events into a shared queue, so a quiet
prompt never delays a busy one. ``close`` cancels every request that has not finished,
which is how a client hanging up stops all of its prompts.

``first`` serves the hold before a streamed response commits its status: it waits until
every request has said something (its first token, or its refusal), so a prompt that is
too long is a 400, not an in-band error after a 200 (bounded by ``stream_hold_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import Request

from gateway.errors import failure
from gateway.queue_client import ClientGone, Generation, QueueClient
from protocol.models import GenerateRequest, TokenEvent

Batch = list[tuple[int, list[TokenEvent]]]
"""(prompt index, that request's events in order), as they became ready."""


class Generations:
    def __init__(self, queue: QueueClient, generations: list[Generation]) -> None:
        self.queue = queue
        self.items = generations
        self._ready: asyncio.Queue[tuple[int, list[TokenEvent] | BaseException]] | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, queue: QueueClient, requests: list[GenerateRequest],
                    received_at: float) -> Generations:
        """Subscribe and enqueue every request; if one fails, the ones started are
        cancelled and the error is raised."""
        started: list[Generation] = []
        try:
            for request in requests:
                started.append(await queue.start(request, received_at))
        except BaseException:
            await cls(queue, started).close()
            raise
        return cls(queue, started)

    @property
    def finished(self) -> bool:
        return all(g.finished for g in self.items)

    async def next(self, wait: float) -> Batch:
        """Events that arrive within ``wait`` s (maybe none); StreamTimeout past the
        deadline, like ``Generation.next``."""
        if len(self.items) == 1:
            events = await self.items[0].next(wait)
            return [(0, events)] if events else []
        queue = self._start_pumps()
        try:
            first = await asyncio.wait_for(queue.get(), wait)
        except asyncio.TimeoutError:
            return []
        items = [first]
        while not queue.empty():
            items.append(queue.get_nowait())
        batch: Batch = []
        for index, got in items:
            if isinstance(got, BaseException):
                raise got
            batch.append((index, got))
        return batch

    def _start_pumps(self) -> asyncio.Queue[tuple[int, list[TokenEvent] | BaseException]]:
        if self._ready is None:
            self._ready = asyncio.Queue()
            self._pumps = [asyncio.create_task(self._pump(i, g))
                           for i, g in enumerate(self.items)]
        return self._ready

    async def _pump(self, index: int, generation: Generation) -> None:
        assert self._ready is not None
        wait = self.queue.settings.keepalive_s
        try:
            while not generation.finished:
                events = await generation.next(wait)
                if events:
                    self._ready.put_nowait((index, events))
        except Exception as exc:  # handed to the reader, who raises it
            self._ready.put_nowait((index, exc))

    async def first(self, http: Request, hold_s: float) -> Batch:
        """Events until every request has sent one, one of them failed, or ``hold_s``
        passed; ClientGone if the client hangs up meanwhile."""
        held: Batch = []
        seen: set[int] = set()
        deadline = time.monotonic() + hold_s
        check = self.queue.settings.disconnect_check_s
        while len(seen) < len(self.items):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = await self.next(min(left, check))
            for index, events in batch:
                held.append((index, events))
                seen.add(index)
                if failure(events[-1]) is not None:
                    return held
            if not batch and await http.is_disconnected():
                raise ClientGone(self.items[0].request_id)
        return held

    async def collect(self, http: Request) -> list[list[TokenEvent]]:
        """Every request's events through its terminal one (or until one fails);
        ClientGone if the client hangs up first."""
        events: list[list[TokenEvent]] = [[] for _ in self.items]
        while not self.finished:
            batch = await self.next(self.queue.settings.disconnect_check_s)
            for index, got in batch:
                events[index] += got
                if failure(got[-1]) is not None:
                    return events
            if not batch and await http.is_disconnected():
                raise ClientGone(self.items[0].request_id)
        return events

    async def close(self) -> None:
        """Close (cancel unless finished) every generation, then stop the pumps.

        In that order: cancelling a pump first, in the middle of its Redis read, left the
        cancel that followed on a broken pooled connection (seen as a lost cancel in
        tests/gateway/test_gateway_clients.py); closed first, each generation's cancel
        runs while its pump only waits."""
        for generation in self.items:
            await generation.close()
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
