"""The benches' standalone output process: token ids in, the same text out, in Redis.

One engine runs its steps with text made in-process (``TextOutputs``), a second one with
its batches sent to ``ops/bench/service/standalone_output.py`` over an ``OutputLink``
(the worker's link, its liveness checks included); every stream's text and
tokens must be equal, a stop string must end its request a step late without the extra
token ever reaching Redis, a stalled output process must coalesce batches (not lose
them), it must never import torch, and its death must surface as ``OutputDied``, as must
a hang (stopped: its pings unanswered, or a pipe it no longer reads).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest

from ops.bench.service import standalone_output
from protocol.codec import decode_event
from protocol.keys import Keys
from protocol.sampling import SamplingParams
from tests.worker.service.conftest import make_engine
from worker.engine.output.rust_decode import decode_spec
from worker.engine.output.text_output import TextOutputs
from worker.service.output_proc import link as m
from worker.service.output_proc.link import OutputDied, OutputLink


def _workload(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(10):
        prompt = [(13 * i + 7 * k) % (vocab - 3) + 3 for k in range(5 + i)]
        params: dict[str, Any] = {"max_tokens": 6 + i, "ignore_eos": True}
        if i % 2:
            params |= {"temperature": 0.8, "top_p": 0.95, "seed": i}
        else:
            params |= {"temperature": 0.0}
        out.append((f"r{i}", prompt, SamplingParams(**params)))
    return out


def _in_process(checkpoint: str, work: list[Any]) -> dict[str, tuple[str, list[int]]]:
    engine = make_engine(checkpoint)
    text = TextOutputs(engine)
    for rid, prompt, params in work:
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[str, list[int]]] = {rid: ("", []) for rid, _, _ in work}
    while engine.has_unfinished_requests():
        for out in text.step():
            s, ids = got[out.request_id]
            got[out.request_id] = (s + out.text, ids + out.new_token_ids)
    return got


def _with_stop(checkpoint: str, work: list[Any]) -> list[Any]:
    """Give r0 a stop string: the text of its third token onwards (so it ends early)."""
    plain = _in_process(checkpoint, work)
    text = plain["r0"][0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    rid, prompt, params = work[0]
    work[0] = (rid, prompt, params.model_copy(update={"stop": [stop]}))
    return work


def _published(redis_client: Any, rid: str) -> tuple[str, list[int], list[int]]:
    events = [decode_event(x) for x in redis_client.lrange(Keys("ferry").events(rid), 0, -1)]
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].finish_reason is not None
    return ("".join(e.text for e in events), [t for e in events for t in e.token_ids],
            [len(e.token_ids) for e in events])


def _start(engine: Any, url: str | None, hang_s: float | None = None) -> OutputLink:
    return standalone_output.start({"tokenizer": engine.config.model.model, "redis_url": url,
                                    "collect": True,
                                    "decode_spec": decode_spec(engine.tokenizer)}, hang_s)


def _step(link: OutputLink, engine: Any) -> Any:
    return standalone_output.step(link, engine)


def test_same_streams_and_a_stop_string_ends_one_step_late(
        checkpoint: str, redis_server: Any, redis_client: Any) -> None:
    engine = make_engine(checkpoint)
    work = _with_stop(checkpoint, _workload(engine.runner.shape.vocab_size))
    want = _in_process(checkpoint, work)
    link = _start(engine, redis_server.url)
    for rid, prompt, params in work:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        _step(link, engine)
    link.close()
    assert link.stats["torch_loaded"] is False
    # r0's tokens sampled after its stop string (one step or more, as the output process
    # keeps up) are dropped there, never published: every sampled token is one or the other
    assert link.stats["dropped"] == engine.tokens_generated - link.stats["published"]
    for rid, _, _ in work:
        text, ids, _ = _published(redis_client, rid)
        assert (text, ids) == want[rid], rid
        assert link.texts is not None and link.texts[f"{rid}/0"] == want[rid][0]
    assert link.stats["published"] == sum(len(ids) for _, ids in want.values())


def test_a_stalled_output_process_coalesces_and_loses_nothing(checkpoint: str) -> None:
    engine = make_engine(checkpoint)
    work = _workload(engine.runner.shape.vocab_size)
    want = _in_process(checkpoint, work)
    link = _start(engine, None)
    os.kill(link.proc.pid, signal.SIGSTOP)
    try:
        for rid, prompt, params in work:
            engine.add_request(rid, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            link.send(engine.step())  # the 1 MiB pipe holds them: the engine never waits
            steps += 1
    finally:
        os.kill(link.proc.pid, signal.SIGCONT)
    link.close()
    assert link.stats["batches"] == steps
    assert link.stats["passes"] < steps  # several batches per pass once it woke
    assert link.texts == {f"{rid}/0": want[rid][0] for rid in want}


def test_a_killed_output_process_is_output_died(checkpoint: str) -> None:
    engine = make_engine(checkpoint)
    link = _start(engine, None)
    engine.add_request("k", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    _step(link, engine)
    os.kill(link.proc.pid, signal.SIGKILL)
    link.proc.wait(10)
    with pytest.raises(OutputDied):
        for _ in range(100):
            _step(link, engine)


def test_fast_token_event_bytes_equal_the_codec() -> None:
    from ops.bench.service.standalone_output import token_event_bytes
    from protocol.codec import encode_event
    from protocol.models import TokenEvent

    for rid, seq, ids, text, index in (("a", 0, [1], "x", 0), ("t::b-c", 7, [5, 6], "é😀", 2),
                                       ("z", 3, [9], "", 0)):
        want = encode_event(TokenEvent(request_id=rid, seq=seq, token_ids=ids, text=text,
                                       index=index))
        assert token_event_bytes(rid, seq, ids, text, index) == want


def test_coalesce_merges_a_passes_outputs_per_stream_in_order() -> None:
    from ops.bench.service.standalone_output import coalesce
    from worker.engine.output.outputs import TextOutput

    lp = [(-0.5, [(1, -0.5)])]
    outs = [TextOutput("a", [1], "x", logprobs=lp), TextOutput("b", [7], "q"),
            TextOutput("a", [2], "y", logprobs=lp), TextOutput("a", [3], "z", finished=True,
                                                               finish_reason="stop", logprobs=lp),
            TextOutput("a", [4], "w", index=1), TextOutput("b", [8], "r")]
    merged = coalesce(outs)
    assert [(o.request_id, o.index) for o in merged] == [("a", 0), ("b", 0), ("a", 1)]
    a = merged[0]
    assert (a.new_token_ids, a.text, a.finished, a.finish_reason) == ([1, 2, 3], "xyz", True,
                                                                     "stop")
    assert a.logprobs == lp * 3
    assert (merged[1].new_token_ids, merged[1].text, merged[1].logprobs) == ([7, 8], "qr", None)
    single = [TextOutput("c", [5], "t")]
    assert coalesce(single) is single  # nothing to merge: the same list


def test_publisher_writes_each_event_to_its_list_ttl_and_channel_in_order(
        redis_server: Any, redis_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One script call per pass (split at ``MAX_EVENTS``) makes the writes a pipeline of
    RPUSH, EXPIRE, PUBLISH per event made: the replay lists, their TTL, the channel order."""
    import time

    from worker.engine.output.outputs import TextOutput

    monkeypatch.setattr(standalone_output, "MAX_EVENTS", 3)
    keys = Keys("ferry")
    sub = redis_client.pubsub()
    sub.subscribe(keys.tokens("p1"), keys.tokens("p2"))
    while sub.get_message(timeout=1.0) is not None:
        pass  # the two subscribe confirmations
    publisher = standalone_output.Publisher(redis_server.url, "ferry", 120)
    passes = [[TextOutput("p1", [1], "a"), TextOutput("p2", [2], "b")],
              [TextOutput("p1", [3, 4], "cd"), TextOutput("p2", [5], "é"),
               TextOutput("p1", [6], "", finished=True, finish_reason="length"),
               TextOutput("p2", [7], "f"), TextOutput("p2", [], "", finished=True,
                                                      finish_reason="stop", stop_reason="x")]]
    for outputs in passes:
        publisher.publish(outputs)
    assert publisher.published_tokens == 7 and publisher.seq == {}
    heard: list[Any] = []
    deadline = time.monotonic() + 5
    while len(heard) < 7 and time.monotonic() < deadline:
        message = sub.get_message(timeout=0.5)
        if message is not None and message["type"] == "message":
            heard.append(decode_event(message["data"]))
    sub.close()
    assert [(e.request_id, e.seq, e.token_ids, e.text) for e in heard] == [
        ("p1", 0, [1], "a"), ("p2", 0, [2], "b"), ("p1", 1, [3, 4], "cd"), ("p2", 1, [5], "é"),
        ("p1", 2, [6], ""), ("p2", 2, [7], "f"), ("p2", 3, [], "")]
    for rid in ("p1", "p2"):
        replay = [decode_event(x) for x in redis_client.lrange(keys.events(rid), 0, -1)]
        assert replay == [e for e in heard if e.request_id == rid]
        assert 0 < redis_client.ttl(keys.events(rid)) <= 120
    assert heard[-1].finish_reason == "stop" and heard[-1].stop_reason == "x"


def test_a_stopped_output_process_is_hung_and_killed(checkpoint: str) -> None:
    """SIGSTOP: nothing answers the link's pings, so after ``hang_s`` the next poll kills
    the process and raises ``OutputDied``, as for a dead one (not a stall forever)."""
    engine = make_engine(checkpoint)
    link = _start(engine, None, hang_s=1.0)
    engine.add_request("h", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
    try:
        while not link._answered:  # its main loop answered once: the bound is hang_s
            _step(link, engine)
        os.kill(link.proc.pid, signal.SIGSTOP)
        with pytest.raises(OutputDied, match="hung"):
            while True:  # steps while the request runs, then the idle loop's polls
                _step(link, engine) if engine.has_unfinished_requests() else link.poll()
                time.sleep(0.005)
        assert link.proc.poll() == -signal.SIGKILL  # killed, not left stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(link.proc.pid, signal.SIGCONT)
        link.proc.kill()


def test_a_full_pipe_to_a_stopped_output_process_is_hung(checkpoint: str) -> None:
    """The engine's write onto a pipe nobody reads does not block the loop for good: once
    the pipe took nothing for ``hang_s``, the process is killed and ``OutputDied`` raised."""
    engine = make_engine(checkpoint)
    link = _start(engine, None, hang_s=1.0)
    os.kill(link.proc.pid, signal.SIGSTOP)
    raised: list[BaseException] = []

    def flood() -> None:
        try:
            for _ in range(64):  # 4 MiB: more than the pipe holds
                link.send_message([m.STATS, {"pad": "x" * 65536}, None])
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=flood, daemon=True)
    try:
        thread.start()
        thread.join(120)  # generous: only the outcome is checked, never the time
        assert not thread.is_alive(), "the write blocked on the stopped process for good"
        assert raised and isinstance(raised[0], OutputDied) and "hung" in str(raised[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(link.proc.pid, signal.SIGCONT)
        link.proc.kill()
