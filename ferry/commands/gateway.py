"""``ferry gateway``: the HTTP gateway (OpenAI-compatible API + jobs API) over Redis.

Torch-free by construction: this module imports only typer, and the command imports only
``gateway`` and ``protocol``, so a gateway container needs no GPU stack (a test checks
that ``torch`` never gets imported). It listens on 127.0.0.1 unless ``--host`` says
otherwise (the compose file and the Kubernetes manifests pass ``--host 0.0.0.0``), and
warns when it listens beyond loopback without ``FERRY_API_KEYS``.
"""

from __future__ import annotations

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


def gateway(
    redis_url: RedisUrl = None,
    host: Annotated[str, typer.Option(
        envvar="FERRY_HOST", help="Listen address; 0.0.0.0 for every interface (then set "
        "FERRY_API_KEYS).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="FERRY_PORT")] = 8000,
    workers: Annotated[int, typer.Option(
        min=1, envvar="FERRY_GATEWAY_WORKERS",
        help="Gateway processes sharing the port (uvicorn's multi-process mode).")] = 1,
    prefix: Prefix = None,
    served_model_name: Annotated[str | None, typer.Option(
        envvar="FERRY_SERVED_MODEL_NAME", help="The model name to answer to (besides those "
        "live workers advertise); requests naming another model get 404.")] = None,
    allowed_origins: Annotated[str | None, typer.Option(
        envvar="FERRY_ALLOWED_ORIGINS", help="Browser origins CORS allows, comma-separated "
        "('*': any); unset: no CORS.")] = None,
    log_level: LogLevel = "info",
    redis_cluster: RedisCluster = None,
    stream_shards: StreamShards = None,
    redis_wait_replicas: Annotated[int | None, typer.Option(
        envvar="FERRY_REDIS_WAIT_REPLICAS", help="Cluster: replicas that must have a "
        "request before it is accepted (0: none).")] = None,
) -> None:
    """Serve the HTTP API; other settings come from FERRY_* variables (docs/operations.md)."""
    from gateway.main import serve
    from observability.logging import configure_logging

    configure_logging(level=log_level)
    origins = None if allowed_origins is None else tuple(
        o.strip() for o in allowed_origins.split(",") if o.strip())
    opts = given(prefix=prefix, served_model_name=served_model_name,
                 redis_cluster=redis_cluster, stream_shards=stream_shards,
                 redis_wait_replicas=redis_wait_replicas, allowed_origins=origins)
    serve(redis_url, host=host, port=port, log_level=log_level, workers=workers, **opts)
