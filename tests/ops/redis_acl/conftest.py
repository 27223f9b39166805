"""The ACL tests' server: one redis-server with the ACL file per module, emptied before
each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ops.redis_acl.acl_server import AclRedis


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    srv = AclRedis(tmp_path_factory.mktemp("acl"))
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _clean(server: AclRedis) -> None:
    server.client("ferry-admin").flushall()
