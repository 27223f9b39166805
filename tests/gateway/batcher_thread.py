"""An in-process batcher (``gateway.batcher.driver.run_batcher``) on its own event loop in a
background thread; ``stop()`` ends it the way SIGTERM does (leases released)."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback

from gateway.batcher.driver import run_batcher
from gateway.settings import GatewaySettings


class BatcherThread:
    """``with BatcherThread(settings, "b1"): ...``."""

    def __init__(self, settings: GatewaySettings, batcher_id: str) -> None:
        self.settings = settings
        self.batcher_id = batcher_id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=batcher_id)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await run_batcher(self.settings, self.batcher_id, stop=self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def __enter__(self) -> BatcherThread:
        self.thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(15)
        assert not self.thread.is_alive(), "the batcher did not stop: " + self.where()
        if self.error is not None:
            raise self.error

    def where(self) -> str:
        """Where the batcher's thread is now, and its event loop's tasks (for a hang)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(ended)"
        tasks = ""
        if self._loop is not None:
            try:  # read from another thread: the set may change under us
                tasks = "\n".join(f"{t.get_name()}: {t.get_stack(limit=4)}"
                                  for t in list(asyncio.all_tasks(self._loop)))
            except RuntimeError as exc:
                tasks = f"(unreadable: {exc})"
        return f"thread at\n{stack}\ntasks:\n{tasks}"

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
