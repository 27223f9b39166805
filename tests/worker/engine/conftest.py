"""Every engine test also proves the scheduler's row arrays equal its requests' fields:
each ``Scheduler.schedule`` first checks them (``Scheduler.check_invariants``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker.engine.sched.scheduler import Scheduler


@pytest.fixture(autouse=True)
def _rows_checked_every_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    schedule = Scheduler.schedule

    def checked(self: Scheduler):  # type: ignore[no-untyped-def]
        self.check_invariants()
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", checked)
    yield
