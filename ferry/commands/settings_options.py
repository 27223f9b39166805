"""The CLI options that the gateway and the batcher share: both build ``GatewaySettings``,
so an option left out (None) keeps the setting's own default or its ``FERRY_*`` variable."""

from __future__ import annotations

from typing import Annotated, Any

import typer

RedisUrl = Annotated[str | None, typer.Option(
    envvar="FERRY_REDIS_URL", help="Redis URL (default redis://localhost:6379/0).")]
Prefix = Annotated[str | None, typer.Option(envvar="FERRY_PREFIX")]
LogLevel = Annotated[str, typer.Option(envvar="FERRY_LOG_LEVEL")]
RedisCluster = Annotated[bool | None, typer.Option(
    "--redis-cluster/--no-redis-cluster", envvar="FERRY_REDIS_CLUSTER",
    help="Redis Cluster: --redis-url names any node (database 0).")]
StreamShards = Annotated[int | None, typer.Option(
    envvar="FERRY_STREAM_SHARDS", help="Cluster: request-stream shards (the same on every "
    "gateway, batcher and worker).")]


def given(**values: Any) -> dict[str, Any]:
    """The settings the command line named (None: not given)."""
    return {name: value for name, value in values.items() if value is not None}
