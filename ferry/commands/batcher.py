"""``ferry batcher``: drive the Batch API's batches (validate, feed the queue, collect).

Torch-free, like the gateway (it runs from the gateway's image): it imports ``gateway``
and ``protocol`` only. Run one or several anywhere they reach Redis; they share the work
through per-batch leases (docs/batch.md). SIGTERM stops it at once and hands its batches
to the others; a batcher killed outright loses its batches only for ``FERRY_BATCH_LEASE_S``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ferry.commands.settings_options import (
    LogLevel,
    Prefix,
    RedisCluster,
    RedisUrl,
    StreamShards,
    given,
)


def batcher(
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    batcher_id: Annotated[str | None, typer.Option(
        help="This batcher's lease value (default: host, pid and a random suffix).")] = None,
    health_file: Annotated[Path | None, typer.Option(
        envvar="FERRY_HEALTH_FILE", help="Touched after every scan of the active batches "
        "(a port-free liveness check).")] = None,
    log_level: LogLevel = "info",
    redis_cluster: RedisCluster = None,
    stream_shards: StreamShards = None,
) -> None:
    """Drive batches until SIGTERM; other settings come from FERRY_* variables (the
    batch_* settings and the gateway's limits, docs/operations.md)."""
    import asyncio

    from gateway.batcher.driver import run_batcher
    from gateway.settings import checked_settings
    from observability.logging import configure_logging

    configure_logging(level=log_level)
    overrides = given(redis_url=redis_url, prefix=prefix, redis_cluster=redis_cluster,
                      stream_shards=stream_shards)
    settings = checked_settings("ferry batcher", **overrides)  # a bad tenants file: exit
    asyncio.run(run_batcher(settings, batcher_id, health_file))
