"""The fleet learns together, end to end: real redis-server, real ``ferry worker``
processes with ``--speculative suffix``.

A worker stores each finished output (its prompt's tail and its tokens) and appends it to
the model's draft stream; a worker started later reads the stream into its own store, so
a repeated request is drafted there from the first worker's output: same tokens (greedy,
drafts are verified), far fewer steps. What a worker drafted from is in its heartbeat:
``spec_draft_rows`` row-steps carried drafts, ``spec_store_rows`` of them from past
outputs, ``spec_accept_len`` tokens per drafted row-step, ``spec_fleet_received`` texts
taken from the stream. The stream is per tenant in effect: an output of tenant alice is
filed under alice on the second worker, which drafts bob's identical request from nothing
of hers; every entry names its tenant and the stream expires.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tenants.ids import scoped_id
from tests.redis_server import RedisServer
from tests.worker.service.procs import WorkerProcess, stream_all, tokens_of
from worker.models import default_model_path

PROMPT = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the "
          "directories given on the command line.\"\"\"\n    for top in argv[1:]:\n")
PARAMS = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _worker(server: RedisServer, name: str, log_dir: Path, *args: str) -> WorkerProcess:
    return WorkerProcess(default_model_path(), server.url, name, log_dir,
                         "--speculative", "suffix", *args)


def _serve(server: RedisServer, worker: WorkerProcess, request_id: str,
           tenant: str | None = None) -> tuple[list[int], dict[str, Any]]:
    """One request alone on ``worker`` (of ``tenant``: None, the default one): its tokens,
    and the worker's heartbeat stats written after it ended."""
    if tenant is not None:
        request_id = scoped_id(tenant, request_id)
    events = stream_all(server.url, [GenerateRequest(
        request_id=request_id, tenant=tenant, prompt=PROMPT, params=PARAMS)])[request_id]
    assert events[-1].finish_reason == "length", events[-1]
    return tokens_of(events), worker.heartbeat_after(time.time()).stats


def _stop(worker: WorkerProcess) -> None:
    worker.send(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.log_tail()


def _wait_stat(worker: WorkerProcess, name: str, at_least: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while int((beat := worker.heartbeat_after(time.time())).stats.get(name, 0)) < at_least:
        assert time.monotonic() < deadline, (name, beat.stats, worker.log_tail())


def test_a_worker_started_later_drafts_a_repeat_from_the_fleet(
        server: RedisServer, log_dir: Path) -> None:
    r = server.client()
    with _worker(server, "spec-1", log_dir) as first:
        first.wait_live()
        model = first.heartbeat().model  # type: ignore[union-attr]
        tokens, alone = _serve(server, first, "first")
        _stop(first)  # the second worker takes the repeat
    assert len(tokens) == PARAMS.max_tokens
    assert alone["spec_store_rows"] == 0  # nothing stored before: own drafts only
    assert r.xlen(Keys().drafts(model)) == 1  # appended, and sent before the worker ended

    with _worker(server, "spec-2", log_dir) as second:
        second.wait_live()
        _wait_stat(second, "spec_fleet_received", 1)  # the first worker's output
        again, stats = _serve(server, second, "again")
        _stop(second)
    assert again == tokens  # verified drafts change nothing
    assert stats["spec_fleet_received"] == 1 and stats["spec_fleet_published"] == 1
    assert stats["spec_store_rows"] > 0  # drafted from the first worker's output...
    assert float(stats["spec_accept_len"]) >= 4.0, stats  # ...and accepted
    print(f"\nfirst worker: {alone['spec_accept_len']} tokens per drafted row-step "
          f"({alone['spec_draft_rows']} rows); second, from the fleet: "
          f"{stats['spec_accept_len']} ({stats['spec_draft_rows']} rows, "
          f"{stats['spec_store_rows']} from the store)")


def test_another_tenants_output_is_not_offered_on_another_worker(
        server: RedisServer, log_dir: Path) -> None:
    """Alice's output, written by the first worker, reaches the second; bob's identical
    request there drafts nothing from the store (same tokens), alice's retry does."""
    r = server.client()
    with _worker(server, "tenant-1", log_dir) as first:
        first.wait_live()
        model = first.heartbeat().model  # type: ignore[union-attr]
        tokens, _ = _serve(server, first, "first", "alice")
        _stop(first)
    key = Keys().drafts(model)
    assert [f[b"tenant"] for _, f in r.xrange(key)] == [b"alice"]
    assert r.pttl(key) > 0  # the stream expires (FERRY_SPEC_STORE_TTL_S)

    with _worker(server, "tenant-2", log_dir) as second:
        second.wait_live()
        _wait_stat(second, "spec_fleet_received", 1)
        other, bob = _serve(server, second, "same", "bob")
        again, alice = _serve(server, second, "again", "alice")
        _stop(second)
    assert other == again == tokens
    assert bob["spec_store_rows"] == 0, bob  # nothing of alice's is offered to bob
    assert alice["spec_store_rows"] > 0, alice  # her own output is


def test_fleet_off_writes_nothing_to_the_stream(server: RedisServer, log_dir: Path) -> None:
    r = server.client()
    with _worker(server, "solo", log_dir, "--no-spec-fleet") as solo:
        solo.wait_live()
        model = solo.heartbeat().model  # type: ignore[union-attr]
        tokens, stats = _serve(server, solo, "solo-1")
        _stop(solo)
    assert len(tokens) == PARAMS.max_tokens
    assert int(stats["steps"]) > 0 and "spec_fleet_published" not in stats
    assert not r.exists(Keys().drafts(model))
