"""The output process's service side (``output_service.ServiceOutputs``) on its own: what it
reports back to the engine process besides events."""

from __future__ import annotations

import functools
import os
import pickle
import threading
import time
from types import SimpleNamespace
from typing import Any

from worker.service.jobs import Outgoing
from worker.service.output_proc import link as m
from worker.service.output_proc.process import Inbox
from worker.service.output_proc.service import ServiceOutputs
from worker.service.redis.connection import WorkerSettings


def test_the_outbox_depth_goes_back_for_the_heartbeat() -> None:
    """Redis away: the output process's outbox holds its events, and says how many (the
    engine process adds them to the heartbeat's ``outbox_depth``), again when it changes."""
    sent: list[list[Any]] = []
    settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", worker_id="depth")
    outputs = ServiceOutputs({"settings": pickle.dumps(settings)}, None, sent.append)
    outputs.outbox.put([Outgoing(("s", f"1-{i}"), "r", i, [i], "x") for i in range(5)])
    outputs.flush_stops()
    stats = [msg[1] for msg in sent if msg[0] == m.STATS]
    assert stats == [{"outbox_depth": 5}]
    outputs.flush_stops()  # unchanged: not sent again
    assert len([msg for msg in sent if msg[0] == m.STATS]) == 1
    outputs.close(0.2)  # Redis never came back: abandoned (a resume regenerates them)


def test_a_request_is_held_until_its_terminal_event_is_settled() -> None:
    """A cluster pusher keeps the events it sent for the requests the worker holds, to refill
    a replay log a failover cut short. The output process ends a request when it builds the
    terminal event, which a failing-over master can park: it must still count as held until
    the outbox settles that event (as the engine process's leases do in-process)."""
    sent: list[list[Any]] = []
    settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", worker_id="held")
    outputs = ServiceOutputs({"settings": pickle.dumps(settings)}, None, sent.append)
    held = outputs.held
    job = type("Job", (), {"entry": ("s", "1-0"), "request_id": "r"})()
    outputs.ev.jobs["r"] = job  # admitted
    assert held.holds_request("r")
    del outputs.ev.jobs["r"]  # its terminal event built ...
    final = Outgoing(("s", "1-0"), "r", 3, [], "", event=SimpleNamespace(finish_reason=None))  # type: ignore[arg-type]
    outputs._on_end(job, final)  # type: ignore[arg-type]
    assert held.holds_request("r")  # ... but not yet written
    held.discard(("s", "1-0"))  # the outbox settled it
    assert not held.holds_request("r")
    assert [msg for msg in sent if msg[0] == m.DISCARD] == [[m.DISCARD, ["s", "1-0"]]]
    outputs.close(0.2)


def test_a_full_outbox_is_waiting_not_hung() -> None:
    """Redis away and the outbox full: the main loop waits in ``Outbox.put`` for room, and
    answers the engine's pings meanwhile, so a slow Redis never gets a live output process
    killed as hung (``output_link``'s liveness check)."""
    sent: list[list[Any]] = []
    settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", worker_id="full",
                              max_outbox_events=3)
    outputs = ServiceOutputs({"settings": pickle.dumps(settings)}, None, sent.append)
    rfd, wfd = os.pipe()
    inbox = Inbox(m.FrameReader(rfd))
    outputs.alive = functools.partial(inbox.answer, sent.append)
    events = [Outgoing(("s", f"1-{i}"), "r", i, [i], "x") for i in range(7)]
    outputs.outbox.put(events[:3])
    deadline = time.monotonic() + 30
    while not outputs.outbox._inflight:  # its thread is sending them (retrying)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    outputs.outbox.put(events[3:6])  # the buffer is full now
    more = events[6:]
    waiting = threading.Thread(target=outputs.outbox.put, args=(more, outputs._still_alive),
                               daemon=True)
    waiting.start()
    try:
        for ping in (1, 2):
            m.write_all(wfd, m.frame([m.PING, ping]))
            deadline = time.monotonic() + 30
            while [m.PONG, ping] not in sent:
                assert time.monotonic() < deadline, f"ping {ping} not answered: {sent}"
                time.sleep(0.01)
        assert waiting.is_alive()  # still waiting for room: the events are kept
        assert outputs.outbox.depth == 6
    finally:
        os.close(wfd)
        outputs.close(0.2)
        os.close(rfd)
