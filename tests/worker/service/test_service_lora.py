"""Multi-LoRA through the worker service and a real redis-server: the fleet registry
(``protocol/lora/registry.py``) decides what every worker serves.

A worker started with ``lora_modules`` records them in the registry; a request whose
``model`` names an adapter runs on it (tokens equal to the in-process engine's with the
same adapter); an adapter added to the registry is served at once (loaded on the request
when the sync thread has not picked it up yet) and by a worker started afterwards;
removing it drops it from every worker; ``check_lora`` answers 200 or 400 with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.client import FerryClient
from protocol.codec import decode_heartbeat
from protocol.keys import Keys
from protocol.lora.paths import NOT_ALLOWED
from protocol.lora.registry import LoraRecord, read_adapters, register_adapter
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tokenizer import TokenizerRequest, decode_tokenizer_reply, encode_tokenizer_message
from tests.worker.engine.lora_adapters import write_adapter
from tests.worker.service.conftest import make_engine
from tests.worker.service.procs import tokens_of
from tests.worker.service.test_service_inprocess import Running
from worker import LLM
from worker.engine.lora.targets import base_targets

KEYS = Keys()
MODEL = "ferry"  # WorkerSettings' default served-model name
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("service-lora")
    base = base_targets(AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint)
    return {name: write_adapter(root / name, base, rank=8, seed=seed, std=0.3)
            for seed, name in enumerate(["sql", "support", "big"], start=21)} | {
        "too-big": write_adapter(root / "too-big", base, rank=32, seed=5)}


@pytest.fixture(scope="module")
def want(checkpoint: str, adapters: dict[str, str]) -> dict[str | None, list[int]]:
    """Each adapter's tokens (and the base model's) from the in-process engine."""
    llm = LLM(checkpoint, device="cpu", kv_cache_blocks=64, max_lora_rank=16,
              lora_modules=[f"{n}={adapters[n]}" for n in ("sql", "support", "big")])
    names: list[str | None] = [None, "sql", "support", "big"]
    outs = llm.generate(["def add(a, b):"] * 4, PARAMS, lora_name=names)
    return {name: out.choices[0].token_ids for name, out in zip(names, outs, strict=True)}


def _engine(checkpoint: str, adapters: dict[str, str], modules: tuple[str, ...]) -> Any:
    return make_engine(checkpoint, max_lora_rank=16, enable_lora=True,
                       lora_modules=[f"{n}={adapters[n]}" for n in modules])


def _worker(engine: Any, url: str, adapters: dict[str, str]) -> Running:
    """A worker whose adapter root is the directory the test's adapters are in."""
    return Running(engine, url, lora_roots=(str(Path(adapters["sql"]).parent),))


def _tokens(client: FerryClient, model: str | None) -> list[int]:
    request = GenerateRequest(prompt="def add(a, b):", params=PARAMS, model=model)
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        events = list(sub.events(timeout=60))
    assert events[-1].error is None, events[-1].error
    return tokens_of(events)


def _heartbeat_adapters(client: FerryClient, worker_id: str) -> str:
    raw = client.redis.get(KEYS.worker(worker_id))
    return str(decode_heartbeat(raw).stats.get("lora_adapters", "")) if raw else ""


def _wait(check: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


@pytest.fixture
def clean(client: FerryClient) -> Iterator[FerryClient]:
    client.redis.delete(KEYS.lora_adapters(MODEL))
    yield client
    client.redis.delete(KEYS.lora_adapters(MODEL))


def test_the_fleet_registry_decides_what_every_worker_serves(
        clean: FerryClient, redis_server: Any, checkpoint: str, adapters: dict[str, str],
        want: dict[str | None, list[int]]) -> None:
    client = clean
    first = _worker(_engine(checkpoint, adapters, ("sql",)), redis_server.url, adapters)
    with first:
        worker = first.service.settings.worker_id
        _wait(lambda: "sql" in read_adapters(client.redis, KEYS, MODEL))  # published
        assert _tokens(client, "sql") == want["sql"]
        assert _tokens(client, None) == want[None]
        assert _tokens(client, "some-label") == want[None]  # not an adapter: the base model
        register_adapter(client.redis, KEYS, LoraRecord(name="support",
                                                        path=adapters["support"], parent=MODEL))
        assert _tokens(client, "support") == want["support"]  # loaded on the request
        _wait(lambda: _heartbeat_adapters(client, worker) == "sql,support")
        register_adapter(client.redis, KEYS, LoraRecord(name="big", path=adapters["big"],
                                                        parent=MODEL))
        _wait(lambda: "big" in _heartbeat_adapters(client, worker))  # the sync thread
    # a worker started afterwards, with no modules of its own, serves all three
    with _worker(_engine(checkpoint, adapters, ()), redis_server.url, adapters) as later:
        late_id = later.service.settings.worker_id
        _wait(lambda: _heartbeat_adapters(client, late_id) == "big,sql,support")
        assert _tokens(client, "big") == want["big"]
        client.redis.hdel(KEYS.lora_adapters(MODEL), "big")
        _wait(lambda: _heartbeat_adapters(client, late_id) == "sql,support")
        assert _tokens(client, "big") == want[None]  # no longer an adapter: a plain label


def test_a_bad_registry_entry_is_skipped_and_logged_not_fatal(
        clean: FerryClient, redis_server: Any, checkpoint: str, adapters: dict[str, str],
        want: dict[str | None, list[int]]) -> None:
    client = clean
    register_adapter(client.redis, KEYS, LoraRecord(name="ghost", path="/nonexistent",
                                                    parent=MODEL))
    client.redis.hset(KEYS.lora_adapters(MODEL), "junk", b"not json")
    with _worker(_engine(checkpoint, adapters, ("sql",)), redis_server.url,
                 adapters) as running:
        worker = running.service.settings.worker_id
        _wait(lambda: _heartbeat_adapters(client, worker) == "sql")
        assert _tokens(client, "sql") == want["sql"]
        request = GenerateRequest(prompt="hi", params=PARAMS, model="ghost")
        with client.subscribe(request.request_id) as sub:
            client.enqueue(request)
            events = list(sub.events(timeout=60))
        assert events[-1].error is not None and "ghost" in events[-1].error
        assert events[-1].error_kind == "invalid_request"


def _check_lora(client: FerryClient, name: str, path: str) -> Any:
    request = TokenizerRequest(op="check_lora", reply_id=f"r{time.monotonic_ns()}",
                               deadline=time.time() + 30, lora_name=name, lora_path=path)
    client.redis.rpush(KEYS.tokenizer_requests(MODEL), encode_tokenizer_message(request))
    reply = client.redis.blpop([KEYS.tokenizer_reply(MODEL, request.reply_id)], timeout=30)
    assert reply is not None
    return decode_tokenizer_reply(reply[1])


def test_check_lora_answers_from_a_worker(clean: FerryClient, redis_server: Any,
                                          checkpoint: str, adapters: dict[str, str],
                                          tmp_path: Path) -> None:
    with _worker(_engine(checkpoint, adapters, ()), redis_server.url, adapters):
        ok = _check_lora(clean, "sql", adapters["sql"])
        assert ok.status == 200 and ok.body["rank"] == 8 and ok.body["modules"]
        big = _check_lora(clean, "too-big", adapters["too-big"])
        assert big.status == 400 and "max_lora_rank=16" in big.error
        assert big.param == "lora_path"
        missing = _check_lora(clean, "x", str(Path(adapters["sql"]).parent / "nothing"))
        assert missing.status == 400 and missing.error == NOT_ALLOWED
        assert read_adapters(clean.redis, KEYS, MODEL) == {}  # a check registers nothing
