"""The TTFT trace: each part of a request's time to first token, stamped by the intake
and the engine loop and logged once at its first token (debug level only)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from structlog.testing import capture_logs

from worker.service.metrics.affinity import route_of
from worker.service.ttft_trace import LOGGER, StepTrace, Trace


@dataclass
class _Request:
    created_at: float


@dataclass
class _Job:
    request_id: str
    started_at: float
    request: Any
    trace: Trace = field(default_factory=Trace)


@pytest.fixture
def debug() -> Iterator[None]:
    logger = logging.getLogger(LOGGER)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield
    logger.setLevel(level)


def test_each_part_is_logged_once_at_the_first_token(debug: None) -> None:
    trace = StepTrace("w1")
    assert trace.on
    job = _Job("r1", started_at=10.5, request=_Request(created_at=10.0),
               trace=Trace(pulled_at=10.1, route="affinity", mark_wait_s=0.08,
                           prepared_at=10.3))
    trace.admitted(job)
    with capture_logs() as logs:
        trace.step({"r1": 960}, [], started=11.0, ended=11.2)  # a prefill chunk, no token
        trace.step({}, ["r1"], started=11.2, ended=11.4)
        trace.step({}, ["r1"], started=11.4, ended=11.5)  # a later token: nothing
    assert len(logs) == 1
    line = logs[0]
    assert line["event"] == "request_timeline" and line["request_id"] == "r1"
    assert line["route"] == "affinity" and line["mark_wait_s"] == 0.08
    assert line["cached"] == 960
    parts = {k: line[k] for k in ("queue_s", "prepare_s", "mailbox_s", "engine_wait_s",
                                  "prefill_s")}
    assert parts == pytest.approx({"queue_s": 0.1, "prepare_s": 0.2, "mailbox_s": 0.2,
                                   "engine_wait_s": 0.5, "prefill_s": 0.4})
    assert sum(parts.values()) == pytest.approx(line["ttft_s"]) == pytest.approx(1.4)


def test_off_below_debug_and_forgotten_jobs_are_not_logged(debug: None) -> None:
    trace = StepTrace("w1")
    job = _Job("r2", started_at=1.0, request=_Request(created_at=0.5))
    trace.admitted(job)
    trace.forget("r2")  # cancelled, or its lease lost, before a token
    with capture_logs() as logs:
        trace.step(None, ["r2"], started=2.0, ended=2.5)
    assert logs == []
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    quiet = StepTrace("w1")
    quiet.admitted(job)
    assert not quiet.on
    with capture_logs() as logs:
        quiet.step(None, ["r2"], started=2.0, ended=2.5)
    assert logs == []


def test_without_a_scheduling_step_the_first_token_step_counts_as_the_first() -> None:
    logging.getLogger(LOGGER).setLevel(logging.DEBUG)
    try:
        trace = StepTrace("w1")
        trace.admitted(_Job("r3", started_at=1.0, request=_Request(created_at=0.0),
                            trace=Trace(pulled_at=0.5, route="unmarked")))
        with capture_logs() as logs:
            trace.step(None, ["r3"], started=1.25, ended=1.5)
    finally:
        logging.getLogger(LOGGER).setLevel(logging.NOTSET)
    assert logs[0]["engine_wait_s"] == 0.25 and logs[0]["prefill_s"] == 0.25
    assert logs[0]["mark_wait_s"] is None and logs[0]["mailbox_s"] == 0.0


def test_the_route_of_a_pulled_entry() -> None:
    assert route_of({b"data": b"x"}, "w1") == ("unmarked", None)
    assert route_of({b"prefer": b"w1", b"marked": b"1000", b"pulled": b"1040"}, "w1") \
        == ("affinity", 0.04)
    assert route_of({"prefer": "w2", "marked": "1000", "pulled": "1250"}, "w1") \
        == ("stolen", 0.25)
    assert route_of({b"prefer": b"w2", b"marked": b"x"}, "w1") == ("stolen", None)
