"""A real uvicorn serving a gateway app in a background thread, on a free port."""

from __future__ import annotations

import threading
import time

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.redis_server import free_port


class GatewayServer:
    """``with GatewayServer(settings) as gw: httpx.get(gw.url + "/healthz")``."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning",
            lifespan="on", timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="gateway")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
