"""Slots: the intake takes only what the worker can start soon (pure Python)."""

import threading
import time

from worker.service.intake.slots import Slots


def test_prefetch_caps_entries_waiting_to_start():
    slots = Slots(total=64, prefetch=4)
    assert slots.free() == 4  # a burst: take 4, leave the rest to other workers
    slots.take(4)
    assert slots.free() == 0
    slots.set_running(3)  # three of them started
    assert slots.free() == 3
    slots.take(3)
    slots.set_running(7)
    assert slots.free() == 4


def test_batch_room_caps_when_nearly_full():
    slots = Slots(total=8, prefetch=4)
    slots.take(7)
    slots.set_running(7)
    assert slots.free() == 1
    slots.release(2)  # two finished
    slots.set_running(5)
    assert slots.free() == 3


def test_wait_free_wakes_when_requests_start():
    slots = Slots(total=64, prefetch=2)
    slots.take(2)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.wait_free(timeout=5)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: both entries wait to start
    slots.set_running(2)
    waiter.join(2)
    assert got == [2]
