"""A redis-server that loads ``ops/redis/users.acl``, logged into as each of its users, and
the check that a call is refused for want of a permission."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from protocol.keys import Keys
from tests.redis_server import free_port

ACL = Path(__file__).resolve().parents[3] / "ops" / "redis" / "users.acl"
KEYS = Keys()
DENIED = "(?i)noperm|permission|can.t access"


class AclRedis:
    """A redis-server loading the ACL file; ``url(user)`` logs in with its placeholder password."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(tmp), "--aclfile", str(ACL), "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.log = tmp / "redis.log"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url("ferry-admin")).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(self.log.read_text() if self.log.exists() else "") from None
                time.sleep(0.05)

    def url(self, user: str) -> str:
        role = user.removeprefix("ferry-")
        return f"redis://{user}:change-me-{role}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def denied(call: object, *args: object, **kwargs: object) -> None:
    with pytest.raises((NoPermissionError, ResponseError), match=DENIED):
        call(*args, **kwargs)  # type: ignore[operator]
