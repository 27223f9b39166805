"""The gateway's HTTP APIs (jobs, tenants and quotas, files and batches, /tokenize) served
as the ACL's users: the real gateway app as ferry-gateway, the batcher as ferry-batcher and
the worker side as ferry-worker, then what each of them must not do."""

from __future__ import annotations

import time
from pathlib import Path

from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from tests.ops.redis_acl.acl_server import KEYS, AclRedis, denied
from tests.protocol.fake_worker import FakeWorker, Script


def test_real_gateway_http_api_as_gateway_user(server: AclRedis) -> None:
    """The HTTP gateway itself (startup XGROUP, readiness, jobs API, SSE) as ferry-gateway."""
    import httpx

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer

    settings = GatewaySettings(redis_url=server.url("ferry-gateway"), poll_interval_s=0.2)
    with FakeWorker(server.url("ferry-worker"), Script(tokens=["x", "y"])), \
            GatewayServer(settings) as gw:
        assert httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 200
        reply = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, timeout=10)
        assert reply.status_code == 202, reply.text
        job_id = reply.json()["id"]
        sse = httpx.get(f"{gw.url}/v1/jobs/{job_id}/events", timeout=10)
        assert sse.status_code == 200 and '"finish_reason":"stop"' in sse.text.replace(" ", "")
        assert httpx.get(f"{gw.url}/v1/jobs/{job_id}", timeout=10).json()["state"] == "done"
        assert httpx.get(f"{gw.url}/v1/models", timeout=10).status_code == 200
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert "ferry_gateway_requests_total" in metrics


def test_tenants_and_quotas_as_gateway_user(server: AclRedis, tmp_path: Path) -> None:
    """FERRY_API_KEYS tenants (the naming secret: GET/SET ``ferry:tenant:naming-secret``)
    and a tenants file's quotas (the admission scripts, the in-flight sweep) as
    ferry-gateway, with /metrics behind its key."""
    import hashlib

    import httpx

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer

    url = server.url("ferry-gateway")
    keyed = GatewaySettings(redis_url=url, api_keys=("k1",), metrics_key="m")
    with GatewayServer(keyed) as gw:
        reply = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, timeout=10,
                           headers={"Authorization": "Bearer k1"})
        assert reply.status_code == 202, reply.text
        metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer m"})
        assert 'ferry_gateway_tenant_requests_total{tenant="key-' in metrics.text
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.t]\nkeys_sha256 = ["{hashlib.sha256(b"k2").hexdigest()}"]\n'
                    "max_concurrent = 1\ntokens_per_minute = 1000\n")
    with GatewayServer(GatewaySettings(redis_url=url, tenants_file=str(path))) as gw:
        who = {"Authorization": "Bearer k2"}
        first = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert first.status_code == 202, first.text
        full = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert full.status_code == 429 and "max_concurrent" in full.text  # after a sweep
        job = first.json()["id"]
        assert httpx.delete(f"{gw.url}/v1/jobs/{job}", headers=who).status_code == 202
        again = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert again.status_code == 202, again.text  # the sweep dropped the cancelled job


def test_batch_api_as_gateway_batcher_and_worker_users(server: AclRedis) -> None:
    """Files and batches over HTTP as ferry-gateway, a batcher as ferry-batcher, a worker as
    ferry-worker: upload, a batch run to its end (with a bad line), the output and error
    files, a cancel, deletes; then what the batcher and the gateway may not do."""
    import io
    import json

    import openai

    from gateway.settings import GatewaySettings
    from tests.gateway.batcher_thread import BatcherThread
    from tests.gateway.server import GatewayServer

    common = {"poll_interval_s": 0.2, "batch_poll_interval_s": 0.05}
    gateway = GatewaySettings(redis_url=server.url("ferry-gateway"), **common)
    batcher = GatewaySettings(redis_url=server.url("ferry-batcher"), **common)
    body = {"prompt": "p", "max_tokens": 4}
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": body}) for i in range(3)] + ["{bad"]
    with FakeWorker(server.url("ferry-worker"), Script(tokens=["x", "y"])), \
            GatewayServer(gateway) as gw, BatcherThread(batcher, "acl-batcher"):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        source = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 30
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.05)
        assert done.request_counts.completed == 3 and done.request_counts.failed == 1
        assert len(client.files.content(done.output_file_id).text.splitlines()) == 3
        assert [f.id for f in client.batches.list().data] == [batch.id]
        assert len(client.files.list().data) == 3  # the input, output and error files
        other = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert client.batches.cancel(other.id).status == "cancelling"
        client.files.delete(done.output_file_id)
        client.files.delete(source.id)
    r, g = server.client("ferry-batcher"), server.client("ferry-gateway")
    ensure_group(server.client("ferry-admin"), KEYS)
    denied(r.xreadgroup, KEYS.group, "b", {KEYS.requests: ">"})
    denied(r.delete, KEYS.requests)
    denied(r.set, KEYS.worker("fake"), b"x")
    denied(r.flushall)
    denied(r.keys, "*")
    denied(g.sadd, KEYS.batch_inflight(batch.id), 1)  # progress is the batcher's
    denied(g.hincrby, KEYS.batch(batch.id), "completed", 1)
    denied(g.set, KEYS.batch_lease(batch.id), "me")


def test_tokenizer_routes_as_gateway_and_worker_users(server: AclRedis) -> None:
    """/tokenize as ferry-gateway, answered by the worker's tokenizer responder as
    ferry-worker (the default model's real tokenizer, no model loaded); neither may touch
    the other's side beyond that."""
    import httpx
    from transformers import AutoTokenizer

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer
    from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
    from worker.models import default_model_path
    from worker.service.redis.connection import WorkerSettings
    from worker.service.sidecars.tokenizer_responder import TokenizerResponder

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    prompts = PromptBuilder(tokenizer, PromptLimits(vocab_size=len(tokenizer),
                                                    max_model_len=2048, num_blocks=8,
                                                    block_size=16))
    worker = WorkerSettings(redis_url=server.url("ferry-worker"), worker_id="acl-tok",
                            model_name="m")
    beat = WorkerHeartbeat(worker_id="acl-tok", model="m", started_at=1.0,
                           updated_at=time.time())
    pipe = server.client("ferry-worker").pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=60))
    pipe.execute()
    responder = TokenizerResponder(worker, prompts, tokenizer, threads=1)
    responder.start()
    settings = GatewaySettings(redis_url=server.url("ferry-gateway"))
    try:
        with GatewayServer(settings) as gw:
            reply = httpx.post(f"{gw.url}/tokenize", json={"prompt": "hello"}, timeout=20)
            assert reply.status_code == 200, reply.text
            assert reply.json()["tokens"] == tokenizer("hello")["input_ids"]
            info = httpx.get(f"{gw.url}/tokenizer_info", timeout=20)
            assert info.json()["eos_token"] == tokenizer.eos_token
    finally:
        responder.stop()
    g, w = server.client("ferry-gateway"), server.client("ferry-worker")
    denied(g.blpop, [KEYS.tokenizer_requests("m")], 1)  # only replies are the gateway's
    denied(g.set, KEYS.tokenizer_requests("m"), b"x")
    denied(w.lrem, KEYS.tokenizer_requests("m"), 1, b"x")
    denied(w.set, KEYS.tokenizer_reply("m", "r"), b"x")
