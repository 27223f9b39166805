"""Fixtures for the protocol tests: a private redis-server per module (tests/redis_server.py)."""

import sys
from pathlib import Path

# `tests.*` imports need the repository root on sys.path; `python -m pytest` from the root
# provides it, plain `pytest` does not.
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.redis_cluster import cluster_client, redis_cluster  # noqa: E402, F401
from tests.redis_server import redis_client, redis_server  # noqa: E402, F401
