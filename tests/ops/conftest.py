"""Fixtures for the benches' tests that run real processes: a private redis-server per
module and the service tests' tiny checkpoint."""

from tests.redis_server import redis_client, redis_server  # noqa: F401
from tests.worker.service.conftest import checkpoint  # noqa: F401
