"""The output process's service side (``output_service.ServiceOutputs``) on its own: what it
reports back to the engine process besides events."""

from __future__ import annotations

import pickle
from typing import Any

from worker.service import output_messages as m
from worker.service.jobs import Outgoing
from worker.service.output_service import ServiceOutputs
from worker.service.redis_io import WorkerSettings


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
