"""``ferry top``'s tenant line: who waits in the fair backlogs, with weight and counter."""

from __future__ import annotations

import redis
from rich.console import Console

from ferry.commands import top as top_cmd
from ferry.fleet import TenantView, collect
from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tenants.ids import scoped_id
from tests.redis_server import RedisServer

KEYS = Keys()


def test_waiting_tenants_are_shown_per_tenant_over_every_lane() -> None:
    with RedisServer() as server:
        client = FerryClient(redis.Redis.from_url(server.url))
        client.ensure_group()
        params = SamplingParams(max_tokens=4)
        for i in range(5):
            client.enqueue(GenerateRequest(request_id=scoped_id("alpha", f"r{i}"),
                                           tenant="alpha", prompt="x", params=params,
                                           priority=i % 2), weight=3)
        client.enqueue(GenerateRequest(request_id="plain", prompt="x", params=params))
        snapshot = collect(server.client(), KEYS)
        console = Console(width=160, record=True)
        console.print(top_cmd.render(snapshot))
        text = console.export_text()
    assert snapshot.tenants == [TenantView("alpha", 5, 3.0, 0.0),
                                TenantView("default", 1, 1.0, 0.0)]
    assert snapshot.queue.lag == 6  # waiting in the backlogs is queued work
    assert "alpha 5 waiting (w 3, vtc 0)" in text and "default 1 waiting" in text
