"""The worker's own LoRA guards, on an in-process worker and a real redis-server: what it
decides however a request or a registry entry reached it.

* ``check_lora`` opens only directories inside its adapter roots, resolved first, and
  refuses everything else with one sentence (no filesystem oracle, no 500);
* a producer cannot run another tenant's adapter by naming its registry key;
* the sync thread survives any registry entry, and adapters registered later still load;
* an adapter whose files went away fails its request with a clear error, without the path;
* the heartbeat carries a bounded list of adapters and their count;
* a name registered again while its old version runs: new requests get the new version at
  once, the running one finishes on the old.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.client import FerryClient
from protocol.codec import decode_heartbeat
from protocol.keys import Keys
from protocol.lora.paths import NOT_ALLOWED
from protocol.lora.registry import LoraRecord
from protocol.models import GenerateRequest, TokenEvent
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
PROMPT = "def add(a, b):"
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=440, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tree(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``root/`` (the worker's adapter root) with two good adapters, ``outside/`` with one
    more, and the hostile entries of a root: a file, a symlink out, a symlink inside."""
    from transformers import AutoModelForCausalLM

    top = tmp_path_factory.mktemp("lora-guards")
    base = base_targets(AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint)
    root, outside = top / "root", top / "outside"
    write_adapter(root / "sql", base, rank=8, seed=41, std=0.3)
    write_adapter(root / "support", base, rank=8, seed=42, std=0.3)
    write_adapter(outside / "stolen", base, rank=8, seed=43, std=0.3)
    (root / "a-file").write_text("not an adapter")
    (root / "link-out").symlink_to(outside / "stolen")
    (root / "link-in").symlink_to(root / "sql")
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def want(checkpoint: str, tree: dict[str, Path]) -> dict[str | None, list[int]]:
    llm = LLM(checkpoint, device="cpu", kv_cache_blocks=64, max_lora_rank=16,
              lora_modules=[f"{n}={tree['root'] / n}" for n in ("sql", "support")])
    names: list[str | None] = [None, "sql", "support"]
    outs = llm.generate([PROMPT] * 3, PARAMS, lora_name=names)
    texts = {name: out.choices[0].token_ids for name, out in zip(names, outs, strict=True)}
    [long] = llm.generate([PROMPT], LONG, lora_name=["sql"])
    return texts | {"sql-long": long.choices[0].token_ids}


def _worker(checkpoint: str, url: str, roots: tuple[str, ...], **engine: Any) -> Running:
    return Running(make_engine(checkpoint, max_lora_rank=16, enable_lora=True, **engine), url,
                   lora_roots=roots)


def _register(client: FerryClient, name: str, path: Path | str, **fields: Any) -> LoraRecord:
    record = LoraRecord(name=name, path=str(path), parent=MODEL, **fields)
    client.redis.hset(KEYS.lora_adapters(MODEL), name, record.encode())
    return record


def _events(client: FerryClient, request: GenerateRequest) -> list[TokenEvent]:
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        return list(sub.events(timeout=60))


def _run(client: FerryClient, model: str | None, tenant: str | None = None,
         rid: str | None = None, params: SamplingParams = PARAMS) -> list[TokenEvent]:
    extra = {} if rid is None else {"request_id": rid}
    return _events(client, GenerateRequest(prompt=PROMPT, params=params, model=model,
                                           tenant=tenant, **extra))


def _stats(client: FerryClient, worker: Running) -> dict[str, Any]:
    raw = client.redis.get(KEYS.worker(worker.service.settings.worker_id))
    return dict(decode_heartbeat(raw).stats) if raw else {}


def _wait(check: Any, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _check_lora(client: FerryClient, path: str) -> Any:
    request = TokenizerRequest(op="check_lora", reply_id=f"r{time.monotonic_ns()}",
                               deadline=time.time() + 30, lora_name="x", lora_path=path)
    client.redis.rpush(KEYS.tokenizer_requests(MODEL), encode_tokenizer_message(request))
    reply = client.redis.blpop([KEYS.tokenizer_reply(MODEL, request.reply_id)], timeout=30)
    assert reply is not None
    return decode_tokenizer_reply(reply[1])


@pytest.fixture
def clean(client: FerryClient) -> Iterator[FerryClient]:
    client.redis.delete(KEYS.lora_adapters(MODEL))
    yield client
    client.redis.delete(KEYS.lora_adapters(MODEL))


def test_check_lora_opens_only_the_roots_and_refuses_alike(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    refused = [str(outside / "stolen"),  # a good adapter, outside the roots
               str(root / "missing"), str(root / "a-file"), str(root / "link-out"),
               f"{root}/../outside/stolen", "/proc/1/root", "/etc", "/root", "/",
               "sql", str(root) + "\x00/sql"]
    with _worker(checkpoint, redis_server.url, (str(root),)):
        for path in refused:
            reply = _check_lora(clean, path)
            assert (reply.status, reply.error, reply.param) == (400, NOT_ALLOWED, "lora_path"), \
                (path, reply)
        for path in (root / "sql", root / "link-in"):  # a symlink that stays inside is fine
            reply = _check_lora(clean, str(path))
            assert reply.status == 200 and reply.body["rank"] == 8, reply
        deep = root / "deep-check"  # a config that breaks the JSON parser: a 400, no 500
        shutil.copytree(root / "sql", deep)
        (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
        try:
            reply = _check_lora(clean, str(deep))
        finally:
            shutil.rmtree(deep)
        assert (reply.status, reply.param) == (400, "lora_path"), reply
        assert str(root) not in (reply.error or ""), reply
    with _worker(checkpoint, redis_server.url, ()):  # no roots: no loading by path at all
        reply = _check_lora(clean, str(root / "sql"))
        assert (reply.status, reply.error) == (400, NOT_ALLOWED)


def test_no_producer_runs_another_tenants_adapter(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path],
        want: dict[str | None, list[int]]) -> None:
    _register(clean, "alpha::sql", tree["root"] / "sql", owner="alpha")
    with _worker(checkpoint, redis_server.url, (str(tree["root"]),)):
        own = _run(clean, "alpha::sql", "alpha", "alpha::own-1")
        assert own[-1].error is None and tokens_of(own) == want["sql"]
        for tenant, rid in (("beta", "beta::steal-1"), (None, "steal-2")):
            events = _run(clean, "alpha::sql", tenant, rid)
            end = events[-1]
            assert end.finish_reason == "error" and not tokens_of(events), events
            assert (end.error_kind, end.error_code, end.error_param) == (
                "invalid_request", "model_not_found", "model")
            assert "does not exist" in (end.error or "")


def test_the_sync_thread_survives_any_entry(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path],
        tmp_path: Path) -> None:
    """Entries that break the loader in every way, registered before the worker starts,
    are skipped; an adapter registered afterwards is loaded by the sync thread alone (no
    request asks for it)."""
    root = tree["root"]
    deep = root / f"deep-{tmp_path.name}"
    shutil.copytree(root / "sql", deep)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    _register(clean, "deep", deep)
    _register(clean, "outside", tree["outside"] / "stolen")
    _register(clean, "gone", root / "never-there")
    clean.redis.hset(KEYS.lora_adapters(MODEL), "junk", b"\xff not json")
    try:
        with _worker(checkpoint, redis_server.url, (str(root),)) as worker:
            _wait(lambda: bool(_stats(clean, worker)), "a heartbeat")
            _register(clean, "later", root / "support")
            _wait(lambda: "later" in str(_stats(clean, worker).get("lora_adapters")),
                  "the adapter registered later to be loaded")
            assert worker.service.lora._thread.is_alive()
            for name in ("deep", "outside", "gone"):
                end = _run(clean, name)[-1]
                assert end.finish_reason == "error" and end.error_code == "adapter_unavailable"
                assert str(root.parent) not in (end.error or ""), end.error
    finally:
        shutil.rmtree(deep)


def test_removed_files_give_a_clear_error_without_the_path(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path],
        want: dict[str | None, list[int]], tmp_path: Path) -> None:
    """One host-cache place: ``sql`` is pushed out by ``support``, then its files go; the
    next request on it is a 400 naming ``model`` that says why, not a 500 with the path."""
    root = tree["root"]
    copy = root / f"copy-{tmp_path.name}"
    shutil.copytree(root / "sql", copy)
    _register(clean, "sql", copy)
    _register(clean, "support", root / "support")
    try:
        with _worker(checkpoint, redis_server.url, (str(root),), max_loras=1,
                     max_cpu_loras=1):
            assert tokens_of(_run(clean, "sql")) == want["sql"]
            assert tokens_of(_run(clean, "support")) == want["support"]  # sql leaves the cache
            shutil.rmtree(copy)
            end = _run(clean, "sql")[-1]
            assert end.finish_reason == "error", end
            assert (end.error_kind, end.error_code, end.error_param) == (
                "invalid_request", "adapter_unavailable", "model")
            assert "'sql'" in (end.error or "") and str(copy) not in (end.error or "")
            assert str(root) not in (end.error or ""), end.error
            assert tokens_of(_run(clean, "support")) == want["support"]  # the rest serves on
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_the_heartbeat_lists_a_bounded_number_of_adapters(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path]) -> None:
    for i in range(20):
        _register(clean, f"many-{i:02d}", tree["root"] / "sql")
    with _worker(checkpoint, redis_server.url, (str(tree["root"]),)) as worker:
        _wait(lambda: _stats(clean, worker).get("lora_adapters_loaded") == 20,
              "the 20 adapters to load")
        listed = str(_stats(clean, worker)["lora_adapters"]).split(",")
        assert len(listed) == 16 and set(listed) <= {f"many-{i:02d}" for i in range(20)}


def test_a_name_registered_again_serves_new_requests_at_once(
        clean: FerryClient, redis_server: Any, checkpoint: str, tree: dict[str, Path],
        want: dict[str | None, list[int]]) -> None:
    """``sql`` is registered again with ``support``'s files while a long request runs on
    it: the long one finishes on the old weights, and every new request is served (the
    old version, until this worker has loaded the new one, then the new one); none fails
    waiting for the long one's end."""
    root = tree["root"]
    _register(clean, "sql", root / "sql")
    worker = _worker(checkpoint, redis_server.url, (str(root),))
    worker.service.lora.interval_s = 0.1  # the registry read every 0.1 s: no long wait
    with worker:
        assert tokens_of(_run(clean, "sql")) == want["sql"]
        request = GenerateRequest(prompt=PROMPT, params=LONG, model="sql")
        with clean.subscribe(request.request_id) as sub:
            clean.enqueue(request)
            stream = sub.events(timeout=120)
            head = [next(stream)]
            while not head[-1].token_ids:
                head.append(next(stream))
            record = _register(clean, "sql", root / "support")  # registered again
            served: list[list[int]] = []
            while not served or served[-1] != want["support"]:
                events = _run(clean, "sql")
                assert events[-1].error is None, events[-1].error
                served.append(tokens_of(events))
                assert len(served) < 200, "the new version never arrived"
            status = clean.result(request.request_id)
            assert status is not None and status.state == "running", \
                "the long request ended before the new version served: nothing was tested"
            assert set(map(tuple, served)) <= {tuple(want["sql"]), tuple(want["support"])}
            assert worker.service.lora.manager.cache.registrations["sql"] == record.version
            events = head + list(stream)
        assert events[-1].finish_reason == "length", events[-1]
        assert tokens_of(events) == want["sql-long"]  # the old weights throughout
