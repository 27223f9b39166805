"""The prefix cache across tenants, end to end: HTTP -> gateway (a tenants file) -> Redis
-> a real ``ferry worker`` (its output process) -> usage.

A caller is shown its own hits only: tenant B sending the prompt tenant A just sent gets
``cached_tokens: 0`` (and computes it: no timing oracle), A's repeat reports its hit, on
completions and chat (whole and streamed), ``/v1/responses``, the jobs API and the Batch
API (each result and the batch's total). ``cache_salt`` is accepted on every route and
isolates within a tenant; a bad one is a 400 naming it. Tenants of one
``prefix_cache_group`` share their prefixes, on purpose.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import GatewaySettings
from tests.gateway.batcher_thread import BatcherThread
from tests.gateway.server import GatewayServer
from tests.worker.service.procs import WorkerProcess


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = f"""
[tenants.alpha]
keys_sha256 = ["{_sha('alpha-key')}"]

[tenants.beta]
keys_sha256 = ["{_sha('beta-key')}"]

[tenants.gamma]
keys_sha256 = ["{_sha('gamma-key')}"]
prefix_cache_group = "public"

[tenants.delta]
keys_sha256 = ["{_sha('delta-key')}"]
prefix_cache_group = "public"
"""
TEXT = ("The quarterly report lists revenue by region, the open incidents and their "
        "owners, the hiring plan for the next two quarters, and the budget of each team "
        "with the variance against the plan; then it lists the risks. ")


def _prompt(tag: str) -> str:
    return f"{tag}. " + TEXT * 2  # well over a few 16-token blocks


@pytest.fixture(scope="module")
def stack(redis_server: Any, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = GatewaySettings(redis_url=redis_server.url, tenants_file=str(tenants),
                               batch_poll_interval_s=0.05, max_tokens_limit=64)
    logs: Path = tmp_path_factory.mktemp("logs")
    with WorkerProcess(checkpoint, redis_server.url, "prefix-tenants-1", logs) as worker:
        worker.wait_live()
        with GatewayServer(settings) as gateway, BatcherThread(settings, "pt-batcher"):
            yield SimpleNamespace(url=gateway.url)


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {who}-key"}


def _post(stack: Any, who: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, headers=_auth(who), timeout=120)


def _cached(stack: Any, who: str, prompt: str, **extra: Any) -> int:
    """A completion of ``prompt`` as ``who``: its usage's cached prompt tokens."""
    reply = _post(stack, who, "/v1/completions", {
        "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_caller_sees_its_own_hits_only(stack: Any) -> None:
    prompt = _prompt("own hits")
    assert _cached(stack, "alpha", prompt) == 0
    assert _cached(stack, "beta", prompt) == 0  # alpha's prompt is nothing to beta
    assert _cached(stack, "alpha", prompt) > 0
    assert _cached(stack, "beta", prompt) > 0  # beta's own, computed by its first
    chat = {"messages": [{"role": "user", "content": _prompt("chat")}], "max_tokens": 2,
            "temperature": 0}
    first = _post(stack, "alpha", "/v1/chat/completions", chat).json()["usage"]
    again = _post(stack, "alpha", "/v1/chat/completions", chat).json()["usage"]
    other = _post(stack, "beta", "/v1/chat/completions", chat).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    hit = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < hit < again["prompt_tokens"]
    # streamed: the final usage chunk, chat and completions
    chunks = _stream(stack, "alpha", "/v1/chat/completions", {
        **chat, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    chunks = _stream(stack, "beta", "/v1/completions", {
        "prompt": prompt, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _stream(stack: Any, who: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{stack.url}{path}", json=body, headers=_auth(who),
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_responses_and_jobs_report_cached_tokens(stack: Any) -> None:
    body = {"input": _prompt("responses"), "max_output_tokens": 2, "temperature": 0}
    usages = [_post(stack, who, "/v1/responses", body).json()["usage"]
              for who in ("alpha", "beta", "alpha")]
    assert [u["input_tokens_details"]["cached_tokens"] > 0 for u in usages] == \
        [False, False, True]
    events = _stream(stack, "alpha", "/v1/responses", {**body, "stream": True})
    done = [e for e in events if e.get("type") in ("response.completed", "response.incomplete")]
    assert done[0]["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
    job = {"prompt": _prompt("jobs"), "params": {"max_tokens": 2, "temperature": 0},
           "stream": False}
    seen = []
    for i, who in enumerate(("alpha", "beta", "alpha", "alpha")):
        salt = {"cache_salt": "s1"} if i == 3 else {}
        created = _post(stack, who, "/v1/jobs", {**job, **salt})
        assert created.status_code == 202, created.text
        seen.append(_job_usage(stack, who, created.json()["id"])["cached_tokens"])
    assert seen[0] == 0 and seen[1] == 0 and seen[2] > 0 and seen[3] == 0


def _job_usage(stack: Any, who: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while True:
        status = httpx.get(f"{stack.url}/v1/jobs/{job_id}", headers=_auth(who)).json()
        if status["state"] == "done":
            return dict(status["usage"])
        assert status["state"] in ("queued", "running") and time.monotonic() < deadline
        time.sleep(0.05)


def test_cache_salt_isolates_within_a_tenant_and_is_validated(stack: Any) -> None:
    prompt = _prompt("salted")
    assert _cached(stack, "alpha", prompt) == 0
    assert _cached(stack, "alpha", prompt, cache_salt="user-1") == 0
    assert _cached(stack, "alpha", prompt, cache_salt="user-2") == 0
    assert _cached(stack, "beta", prompt, cache_salt="user-1") == 0
    assert _cached(stack, "alpha", prompt, cache_salt="user-1") > 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad = [5, "", "a\nb", "\x07", "x" * 257, ["s"]]
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", chat),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                       ("/v1/jobs", {"prompt": "hi", "params": {"max_tokens": 1}})):
        for value in bad:
            reply = _post(stack, "alpha", path, {**body, "cache_salt": value})
            assert reply.status_code == 400, (path, value, reply.text)
            assert reply.json()["error"]["param"] == "cache_salt", (path, reply.text)
            assert "Traceback" not in reply.text
    # a caller cannot name a partition itself: cache_scope is the gateway's to set
    reply = _post(stack, "alpha", "/v1/jobs", {"prompt": "hi", "cache_scope": "public"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_scope"
    prompt = _prompt("scope")
    _cached(stack, "gamma", prompt)
    assert _cached(stack, "alpha", prompt, cache_scope="public") == 0  # ignored field


def test_a_prefix_cache_group_shares_on_purpose(stack: Any) -> None:
    prompt = _prompt("public system prompt")
    assert _cached(stack, "gamma", prompt) == 0
    assert _cached(stack, "delta", prompt) > 0  # the group's one space
    assert _cached(stack, "alpha", prompt) == 0  # outside the group: nothing
    assert _cached(stack, "gamma", prompt, cache_salt="mine") == 0


def test_batch_results_report_cached_tokens(stack: Any) -> None:
    prompt = _prompt("batch")
    assert _cached(stack, "alpha", prompt) == 0
    totals = {}
    for who in ("alpha", "beta"):
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=f"{who}-key",
                               max_retries=0)
        line = json.dumps({"custom_id": "one", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": prompt, "max_tokens": 2, "temperature": 0}})
        source = client.files.create(file=("in.jsonl", io.BytesIO(line.encode() + b"\n")),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id, batch
        row = json.loads(client.files.content(batch.output_file_id).text)
        usage = row["response"]["body"]["usage"]
        assert batch.usage is not None
        assert batch.usage.input_tokens_details.cached_tokens == \
            usage["prompt_tokens_details"]["cached_tokens"]
        totals[who] = usage["prompt_tokens_details"]["cached_tokens"]
    assert totals["alpha"] > 0 and totals["beta"] == 0


def test_n_choices_report_the_prompt_once(stack: Any) -> None:
    """Two candidates of one prompt: the second shares the first's blocks in the very step
    that computes them, yet the request's prompt was not served from the cache: the
    request reports the fewest of its candidates (0), and its repeat the hit."""
    prompt = _prompt("two choices")
    assert _cached(stack, "alpha", prompt, n=2) == 0
    assert _cached(stack, "alpha", prompt, n=2) > 0
