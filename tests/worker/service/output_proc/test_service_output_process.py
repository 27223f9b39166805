"""``FERRY_OUTPUT_PROCESS`` (on by default): a worker whose text, events and Redis writes
are made by its output process streams exactly what the in-process path
(``FERRY_OUTPUT_PROCESS=0``) streams, and a kill -9 of that
process ends the worker (exit 71) while a restarted worker resumes its requests from the
replay log with the same final text; so does a SIGSTOP of it (a hung output process)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent
from protocol.sampling import SamplingParams
from tests.redis_server import RedisServer
from tests.worker.service.procs import (
    Monitor,
    Streams,
    WorkerProcess,
    assert_contiguous,
    stream_all,
    tokens_of,
)

KEYS = Keys()
OUT = {"FERRY_OUTPUT_PROCESS": "1"}
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Hello there, friend"]


def _requests(stop_strings: dict[str, str]) -> list[GenerateRequest]:
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        reqs.append(GenerateRequest(prompt=prompt, params=SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True)))
        reqs.append(GenerateRequest(prompt=prompt, params=SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True, stop=[stop_strings[prompt]])))
        reqs.append(GenerateRequest(prompt=prompt, params=SamplingParams(
            max_tokens=20, temperature=1.0, seed=7 + i, logprobs=2, ignore_eos=True)))
        reqs.append(GenerateRequest(prompt=prompt, params=SamplingParams(
            max_tokens=16, temperature=1.0, seed=11 + i, n=2, ignore_eos=True)))
        reqs.append(GenerateRequest(prompt=prompt, stream=False, params=SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_strings[prompt]])))
    return reqs


def _stop_strings(reference: Any) -> dict[str, str]:
    """A stop string per prompt that its greedy text reaches mid-way (so it ends early)."""
    out = {}
    for prompt in PROMPTS:
        _, text = reference.run(prompt, SamplingParams(max_tokens=60, temperature=0,
                                                       ignore_eos=True))
        out[prompt] = text[len(text) // 3: len(text) // 3 + 2] or "e"
    return out


class _Close(float):
    """A logprob equal to another within 1e-4: a step's float sums vary in the last bits
    with what else is in the batch (rounding both to 4 places flips at a boundary)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(self - other) <= 1e-4

    __hash__ = float.__hash__


def _view(events: list[TokenEvent]) -> list[Any]:
    """What a client sees, less the request id, times and the worker; logprobs ``_Close``."""
    seen = []
    for e in events:
        d = e.model_dump(exclude={"request_id", "timings", "worker_id", "version"})
        for lps in [d["logprobs"], *(c["logprobs"] for c in d["choices"] or [])]:
            for lp in lps or []:
                lp["logprob"] = _Close(lp["logprob"])
                for top in lp["top"]:
                    top["logprob"] = _Close(top["logprob"])
        seen.append(d)
    return seen


def _serve(checkpoint: str, url: str, wid: str, log_dir: Path, env: dict[str, str],
           requests: list[GenerateRequest], module: str = "ferry.cli",
           cluster: bool = False) -> list[list[Any]]:
    with WorkerProcess(checkpoint, url, wid, log_dir, env=env, module=module,
                       cluster=cluster) as w:
        w.wait_live()
        on = env.get("FERRY_OUTPUT_PROCESS", "1") == "1"  # on by default
        assert (_output_pid(w, 5.0) > 0) if on else "output_process" not in w.log_tail(400)
        results = stream_all(url, requests, cluster=cluster)
    return [_view(results[r.request_id]) for r in requests]


def test_output_process_streams_what_the_in_process_path_streams(
        redis_server: Any, checkpoint: str, log_dir: Path, reference: Any) -> None:
    stops = _stop_strings(reference)
    url = redis_server.url
    inproc = _serve(checkpoint, url, "in-proc", log_dir, {"FERRY_OUTPUT_PROCESS": "0"},
                    _requests(stops))
    outproc = _serve(checkpoint, url, "out-proc", log_dir, {}, _requests(stops))  # default
    stopped = 0
    for i, (a, b) in enumerate(zip(inproc, outproc, strict=True)):
        assert a == b, i
        stopped += a[-1]["finish_reason"] == "stop"
    assert stopped >= len(PROMPTS)  # the stop strings did end requests early


def _failing(run: str, n: int, stream: bool) -> list[GenerateRequest]:
    """Requests whose candidate 1 fails after a few tokens (``failing_choice_worker``)."""
    return [GenerateRequest(
        request_id=f"failchoice-{run}-{n}-{i}", prompt=prompt, stream=stream,
        params=SamplingParams(max_tokens=24, temperature=1.0, seed=40 + i, n=n, logprobs=1,
                              ignore_eos=True)) for i, prompt in enumerate(PROMPTS[:2])]


def test_a_failed_candidate_ends_its_request_as_in_process(
        redis_server: Any, checkpoint: str, log_dir: Path) -> None:
    """Candidate 1 fails: the request fails, its siblings are aborted and listed so in the
    terminal event, with the same events on both paths (streamed and not, n = 2 and 3)."""
    def requests(run: str) -> list[GenerateRequest]:
        return _failing(run, 2, True) + _failing(run, 3, False)

    url, module = redis_server.url, "tests.worker.service.failing_choice_worker"
    inproc = _serve(checkpoint, url, "fail-in", log_dir, {"FERRY_OUTPUT_PROCESS": "0"},
                    requests("in"), module)
    outproc = _serve(checkpoint, url, "fail-out", log_dir, OUT, requests("out"), module)
    for i, (a, b) in enumerate(zip(inproc, outproc, strict=True)):
        assert a == b, i
        final = a[-1]
        assert final["finish_reason"] == "error", final
        reasons = [c["finish_reason"] for c in final["choices"]]
        assert reasons[1] == "error" and "abort" in reasons, reasons


def _output_pid(worker: WorkerProcess, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in worker.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") == "output_process_started":
                    return int(entry["pid"])
        time.sleep(0.1)
    raise AssertionError(f"no output process in the log:\n{worker.log_tail()}")


@pytest.fixture
def server() -> Any:
    with RedisServer(appendonly=True) as srv:
        yield srv


def test_kill9_of_the_output_process_ends_the_worker_and_a_restart_resumes(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    requests = [GenerateRequest(prompt=f"The quick brown fox {i}", params=SamplingParams(
        max_tokens=150, temperature=1.0, seed=100 + i, ignore_eos=True,
        stop=["zzqx"] if i % 2 else [])) for i in range(6)]
    expected = {r.request_id: reference.run(r.prompt, r.params) for r in requests}
    victim = WorkerProcess(checkpoint, server.url, "victim", log_dir, "--lease-s", "2",
                           env=OUT)
    restarted = WorkerProcess(checkpoint, server.url, "restarted", log_dir, "--lease-s", "2",
                              env=OUT)
    r = server.client()
    try:
        victim.start().wait_live()
        pid = _output_pid(victim)
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        deadline = time.monotonic() + 60
        while not any(r.llen(KEYS.events(q.request_id)) >= 5 for q in requests):
            assert time.monotonic() < deadline, "no request got going"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        code = victim.wait(60)
        restarted.start().wait_live()
        results = streams.join()
        monitor.stop()
    finally:
        victim.kill()
        restarted.kill()
    assert code == 71, victim.log_tail()
    for req in requests:
        events = results[req.request_id]
        assert_contiguous(events)
        ids, text = expected[req.request_id]
        assert tokens_of(events) == ids
        assert "".join(e.text for e in events) == text
        assert r.hget(KEYS.job(req.request_id), "state") == b"done"
    assert monitor.duplicates() == {}
    assert any(r.hget(KEYS.job(q.request_id), "worker_id") == b"restarted" for q in requests)
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_a_stopped_output_process_ends_the_worker_and_a_restart_resumes(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    """SIGSTOP of the output process mid-stream: it answers no ping, so the worker kills it
    and exits 71 (it does not wait for it forever while admitting more), and a restarted
    worker resumes every stream from the replay log with the tokens of a run alone."""
    requests = [GenerateRequest(prompt=f"A stopped output process {i}", params=SamplingParams(
        max_tokens=150, temperature=1.0, seed=200 + i, ignore_eos=True)) for i in range(6)]
    expected = {r.request_id: reference.run(r.prompt, r.params) for r in requests}
    victim = WorkerProcess(checkpoint, server.url, "stopped", log_dir, "--lease-s", "2",
                           env={**OUT, "FERRY_OUTPUT_HANG_S": "2"})
    restarted = WorkerProcess(checkpoint, server.url, "after-stop", log_dir, "--lease-s", "2",
                              env=OUT)
    r = server.client()
    pid = 0
    try:
        victim.start().wait_live()
        pid = _output_pid(victim)
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        deadline = time.monotonic() + 60
        while not any(r.llen(KEYS.events(q.request_id)) >= 5 for q in requests):
            assert time.monotonic() < deadline, "no request got going"
            time.sleep(0.02)
        os.kill(pid, signal.SIGSTOP)
        code = victim.wait(90)  # generous: only the outcome is checked, never the time
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
            os.kill(pid, 0)
        restarted.start().wait_live()
        results = streams.join()
        monitor.stop()
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        victim.kill()
        restarted.kill()
    assert code == 71, victim.log_tail()
    assert "output process hung" in victim.log_tail(400)
    for req in requests:
        events = results[req.request_id]
        assert_contiguous(events)
        ids, text = expected[req.request_id]
        assert tokens_of(events) == ids
        assert "".join(e.text for e in events) == text
        assert r.hget(KEYS.job(req.request_id), "state") == b"done"
    assert monitor.duplicates() == {}
    assert any(r.hget(KEYS.job(q.request_id), "worker_id") == b"after-stop" for q in requests)
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0
