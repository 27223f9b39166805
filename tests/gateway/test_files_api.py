"""Files API through the official openai SDK: real uvicorn, real Redis. Uploads round-trip
byte for byte; size (413), line count, purpose, encoding and form errors are 4xx naming
the field; pages go newest first; another principal's file is 404 on every route."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from gateway.tenancy.naming import secret_key
from gateway.tenancy.principal import key_principal
from protocol.keys import Keys
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer

KEYS = Keys()
MAX_BYTES, MAX_LINES = 64 * 1024, 20


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=("alice-key", "bob-key"),
                               batch_file_max_bytes=MAX_BYTES, batch_file_max_lines=MAX_LINES,
                               batch_file_ttl_s=3600)
    with GatewayServer(settings) as server:
        yield server


def _client(gateway: GatewayServer, key: str = "alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def _jsonl(n: int, blank_every: int = 0) -> bytes:
    lines = []
    for i in range(n):
        lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                 "url": "/v1/completions", "body": {"prompt": f"é {i}"}}))
        if blank_every and i % blank_every == 0:
            lines.append("  ")
    return ("\r\n".join(lines)).encode()  # CRLF, no final newline: stored as sent


def test_upload_retrieve_content_list_delete(gateway: GatewayServer,
                                            redis_client: redis.Redis) -> None:
    alice = _client(gateway)
    data = _jsonl(7, blank_every=3)
    made = alice.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert (made.object, made.purpose, made.bytes, made.filename) == (
        "file", "batch", len(data), "in.jsonl")
    assert made.expires_at == made.created_at + 3600 and made.status == "processed"
    assert alice.files.retrieve(made.id) == made
    assert alice.files.content(made.id).content == data
    stored = redis_client.hgetall(KEYS.file(made.id))
    secret = redis_client.get(secret_key(KEYS))  # the key's tenant, named by the secret
    assert stored[b"owner"].decode() == key_principal("alice-key", secret)
    assert int(stored[b"requests"]) == 7 and int(stored[b"lines"]) == 10
    assert 3500 < redis_client.ttl(KEYS.file_lines(made.id)) <= 3600
    assert made.id in [f.id for f in alice.files.list()]
    deleted = alice.files.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    assert not redis_client.exists(KEYS.file(made.id), KEYS.file_lines(made.id))
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(made.id)


def test_pages_newest_first_and_expires_after(gateway: GatewayServer,
                                              redis_client: redis.Redis) -> None:
    carol = _client(gateway, "bob-key")
    ids = [carol.files.create(file=(f"{i}.jsonl", io.BytesIO(_jsonl(1))), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": 7200}).id
           for i in range(3)]
    page = carol.files.list(limit=2)
    assert [f.id for f in page.data] == [ids[2], ids[1]] and page.has_more
    rest = carol.files.list(limit=2, after=ids[1])
    assert [f.id for f in rest.data] == [ids[0]] and not rest.has_more
    assert [f.id for f in carol.files.list(order="asc", limit=1).data] == [ids[0]]
    assert [f.id for f in carol.files.list(purpose="batch_output").data] == []
    assert 7100 < redis_client.ttl(KEYS.file(ids[0])) <= 7200
    with pytest.raises(openai.BadRequestError, match="expires_after.seconds"):
        carol.files.create(file=("x.jsonl", io.BytesIO(_jsonl(1))), purpose="batch",
                           expires_after={"anchor": "created_at", "seconds": 60})


def test_another_principals_file_is_404_on_every_route(gateway: GatewayServer,
                                                       redis_client: redis.Redis) -> None:
    alice, bob = _client(gateway), _client(gateway, "bob-key")
    made = alice.files.create(file=("in.jsonl", io.BytesIO(_jsonl(2))), purpose="batch")
    for call in (lambda: bob.files.retrieve(made.id), lambda: bob.files.content(made.id),
                 lambda: bob.files.delete(made.id),
                 lambda: bob.files.retrieve("file-0123456789abcdef"),
                 lambda: bob.files.retrieve("file-{x}")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["param"] == "file_id"  # type: ignore[index]
    assert made.id not in [f.id for f in bob.files.list()]
    assert alice.files.retrieve(made.id).id == made.id  # still there
    reply = httpx.get(f"{gateway.url}/v1/files")
    assert reply.status_code == 401


@pytest.mark.parametrize(("content", "purpose", "status", "param"), [
    (b"x" * (MAX_BYTES + 1), "batch", 413, "file"),  # caught while reading the part
    (b"y" * (MAX_BYTES + 128 * 1024), "batch", 413, "body"),  # refused from Content-Length
    (_jsonl(MAX_LINES + 1), "batch", 400, "file"),
    (b"\n \n", "batch", 400, "file"),
    (b'{"custom_id": "\xff"}\n', "batch", 400, "file"),
    (_jsonl(1), "fine-tune", 400, "purpose"),
])
def test_bad_uploads_are_refused_and_leave_nothing(
        gateway: GatewayServer, redis_client: redis.Redis, content: bytes, purpose: str,
        status: int, param: str) -> None:
    reply = httpx.post(f"{gateway.url}/v1/files", data={"purpose": purpose},
                       files={"file": ("f.jsonl", content)},
                       headers={"Authorization": "Bearer alice-key"}, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
    assert redis_client.keys(KEYS.file_lines("*")) == []  # no half-stored upload


def test_form_errors_name_the_field(gateway: GatewayServer, redis_client: redis.Redis) -> None:
    auth = {"Authorization": "Bearer alice-key"}
    no_file = httpx.post(f"{gateway.url}/v1/files", data={"purpose": "batch"},
                         files={"other": ("x", b"1")}, headers=auth)
    not_multipart = httpx.post(f"{gateway.url}/v1/files", json={"purpose": "batch"},
                               headers=auth)
    for reply in (no_file, not_multipart):
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "file"
    two_files = httpx.post(f"{gateway.url}/v1/files", data={"purpose": "batch"},
                           files=[("file", ("a", b"{}")), ("file", ("b", b"{}"))], headers=auth)
    assert two_files.status_code == 400, two_files.text
