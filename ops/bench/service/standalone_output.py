"""The standalone output process: ``host_step.py``'s measure of the output side alone.

``python -m ops.bench.service.standalone_output RFD WFD``, started through ``start`` (an
``OutputLink`` to this module, not to the worker's ``output_proc.process``). It loads the
tokenizer the worker's way (``output_proc.process.load_tokenizer``; ``window_decode`` and
``decode_stream`` in its ``CONFIG`` pick the detokenizer for an A/B), turns ``StepBatch``es
into text (``StreamTexts``), and publishes plain ``TokenEvent``s to Redis: a pass that took
several steps' batches publishes one event per stream (``coalesce``), every event pushed
to its request's replay list, the list's TTL refreshed and the event published on its
channel, by one ``EVALSHA`` per pass (at most ``MAX_EVENTS`` events a call). It answers
``STOP`` for each stop string and ``STATS`` (with ``collect``: every stream's text at the
end). The worker service's output process writes through its ``Outbox`` instead
(``output_proc/service.py``); this one has no leases, fences or job events.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.engine import EngineEnd, StepBatch, StreamTexts, TextOutput  # noqa: E402
from worker.service.output_proc import link as m  # noqa: E402
from worker.service.output_proc.process import Inbox, load_tokenizer  # noqa: E402

_STATS_EVERY_S = 0.5

MAX_EVENTS = 1024  # events per script call: bounds how long Redis is busy with one

# KEYS: each event's replay list; ARGV: ttl, each event's bytes, each event's channel.
PUSH_EVENTS = """
local n = #KEYS
for i = 1, n do
  local data = ARGV[1 + i]
  redis.call('RPUSH', KEYS[i], data)
  redis.call('EXPIRE', KEYS[i], ARGV[1])
  redis.call('PUBLISH', ARGV[1 + n + i], data)
end
return n
"""


class Publisher:
    """Per-request event numbering and the Redis writes of one pass."""

    def __init__(self, redis_url: str | None, prefix: str, ttl_s: int) -> None:
        from protocol.keys import Keys
        from worker.service.redis.connection import LuaScript

        self.redis = None
        if redis_url:
            import redis

            self.redis = redis.Redis.from_url(redis_url)
        self.keys = Keys(prefix)
        self.ttl_s = ttl_s
        self.seq: dict[str, int] = {}
        self.published_tokens = 0
        self._push = LuaScript(PUSH_EVENTS)
        self._names: dict[str, tuple[str, str]] = {}  # open request: (list, channel)

    def publish(self, outputs: list[TextOutput]) -> None:
        if not outputs:
            return
        lists, data, channels = [], [], []
        seqs, names = self.seq, self._names
        for out in outputs:
            rid = out.request_id
            seq = seqs.get(rid, 0)
            seqs[rid] = seq + 1
            name = names.get(rid)
            if name is None:
                name = names[rid] = (self.keys.events(rid), self.keys.tokens(rid))
            if out.finished:
                del seqs[rid], names[rid]
                data.append(final_event_bytes(out, seq))
            else:
                data.append(token_event_bytes(rid, seq, out.new_token_ids, out.text, out.index))
            lists.append(name[0])
            channels.append(name[1])
        if self.redis is not None:
            for lo in range(0, len(lists), MAX_EVENTS):
                hi = lo + MAX_EVENTS
                self._push.run(self.redis, lists[lo:hi],
                               [self.ttl_s, *data[lo:hi], *channels[lo:hi]])
        self.published_tokens += sum([len(out.new_token_ids) for out in outputs])


def final_event_bytes(out: TextOutput, seq: int) -> bytes:
    """A final ``TokenEvent``'s bytes, through the codec (rare: once per request)."""
    from protocol.codec import encode_event
    from protocol.models import TokenEvent

    return encode_event(TokenEvent(
        request_id=out.request_id, seq=seq, token_ids=out.new_token_ids, text=out.text,
        finish_reason=out.finish_reason,  # type: ignore[arg-type]
        index=out.index, error=out.error, stop_reason=out.stop_reason,
    ))


_VERSION: list[int] = []  # protocol.models.PROTOCOL_VERSION, imported once
_PACK = msgpack.Packer(use_bin_type=True).pack  # one packer (the pass loop's), not one an event


def token_event_bytes(request_id: str, seq: int, token_ids: list[int], text: str,
                      index: int) -> bytes:
    """A non-final ``TokenEvent``'s msgpack, the bytes ``encode_event`` gives, without
    building and validating a pydantic model per token (the output process's hot path)."""
    if not _VERSION:
        from protocol.models import PROTOCOL_VERSION

        _VERSION.append(PROTOCOL_VERSION)
    packed: bytes = _PACK({"version": _VERSION[0], "request_id": request_id, "seq": seq,
                           "token_ids": token_ids, "text": text, "index": index})
    return packed


def coalesce(outputs: list[TextOutput]) -> list[TextOutput]:
    """One output per (request, candidate) of a pass, in first-seen order: a pass that
    took several steps' batches (it fell behind) publishes each stream's tokens as one
    event, so Redis takes a command per stream rather than per stream per step. The
    merged output has every token, text and logprob in order and the last one's end.
    Each stream's outputs are joined once (not merged pairwise, a copy per step)."""
    runs: dict[tuple[str, int], list[TextOutput]] = {}
    for out in outputs:
        key = (out.request_id, out.index)
        run = runs.get(key)
        if run is None:
            runs[key] = [out]
        else:
            run.append(out)
    if len(runs) == len(outputs):
        return outputs
    return [run[0] if len(run) == 1 else _merged(run) for run in runs.values()]


def _merged(run: list[TextOutput]) -> TextOutput:
    last = run[-1]
    lps = [out.logprobs for out in run]
    return dataclasses.replace(
        last, new_token_ids=[t for out in run for t in out.new_token_ids],
        text="".join([out.text for out in run]),
        logprobs=None if all(lp is None for lp in lps) else [x for lp in lps if lp for x in lp],
        prompt_logprobs=next((out.prompt_logprobs for out in run if out.prompt_logprobs),
                             last.prompt_logprobs))


def start(options: dict[str, Any], hang_s: float | None = None) -> m.OutputLink:
    """This process behind an ``OutputLink``: ``options`` are its ``CONFIG`` (tokenizer,
    decode_spec, redis_url, prefix, ttl_s, collect, window_decode, decode_stream)."""
    return m.OutputLink.start(options, hang_s=hang_s, module="ops.bench.service.standalone_output")


def step(link: m.OutputLink, engine: Any) -> StepBatch:
    """One engine step through the output process: the stop strings it found first (each
    ends its request a step late), then the step's batch sent over."""
    for stream, stop_str in link.poll():
        engine.finish_stream(stream, "stop", stop_str)
    batch = engine.step()
    link.send(batch)
    return batch


class StandaloneOutput:
    def __init__(self, rfd: int, wfd: int) -> None:
        self._wfd = wfd
        self._reader = m.FrameReader(rfd)
        self._stops: list[list[Any]] = []
        self.texts: dict[str, list[str]] = {}  # with ``collect``: every stream's pieces
        self.stats = {"tokens": 0, "published": 0, "passes": 0, "batches": 0, "busy_s": 0.0,
                      "busy_cpu_s": 0.0}

    def _send(self, message: list[Any]) -> None:
        m.write_all(self._wfd, m.frame(message))

    def _on_stop(self, stream: int, stop_str: str) -> EngineEnd | None:
        self._stops.append([m.STOP, stream, stop_str])
        return None  # the engine hears of it with the next message: this stream ends here

    def run(self) -> int:
        config = self._reader.read()
        if config is None or config[0] != m.CONFIG:
            return 2
        options: dict[str, Any] = config[1]
        texts = StreamTexts(_decoder(options), self._on_stop)
        publisher = Publisher(options.get("redis_url"), options.get("prefix", "ferry"),
                              int(options.get("ttl_s", 3600)))
        collect = bool(options.get("collect"))
        self._send([m.READY, os.getpid()])
        inbox = Inbox(self._reader)
        last_stats = time.monotonic()
        while True:
            messages = inbox.take(_STATS_EVERY_S)
            start_s, start_cpu = time.perf_counter(), time.thread_time()
            outputs: list[TextOutput] = []
            done = False
            for message in messages:
                if message is None or message[0] == m.QUIT:
                    done = True
                    break
                if message[0] == m.BATCH:
                    self.stats["batches"] += 1
                    outputs += texts.apply(m.unpack_batch(message))
                inbox.answer(self._send)
            inbox.answer(self._send)
            for stop in self._stops:
                self._send(stop)
            self._stops.clear()
            outputs = coalesce(outputs)  # a pass behind by k steps: one event per stream
            publisher.publish(outputs)
            if collect:
                for out in outputs:
                    self.texts.setdefault(f"{out.request_id}/{out.index}", []).append(out.text)
            if messages:
                self.stats["passes"] += 1
                self.stats["busy_s"] += time.perf_counter() - start_s
                self.stats["busy_cpu_s"] += time.thread_time() - start_cpu
            self.stats["tokens"] = texts.tokens_seen
            self.stats["dropped"] = texts.rows_dropped
            self.stats["torch_loaded"] = "torch" in sys.modules
            self.stats["published"] = publisher.published_tokens
            now = time.monotonic()
            if done or now - last_stats >= _STATS_EVERY_S:
                last_stats = now
                joined = {k: "".join(v) for k, v in self.texts.items()} if done and collect \
                    else None
                self._send([m.STATS, dict(self.stats), joined])
            if done:
                return 0


def _decoder(options: dict[str, Any]) -> Any:
    """The worker's decoder, with the A/B switches: ``window_decode`` (the two window
    decodes a token), ``decode_stream`` (``DecodeStream``, not the byte table)."""
    decoder = load_tokenizer(options)
    if options.get("decode_spec") is not None:
        decoder.streams = decoder.streams and not options.get("window_decode")
        if options.get("decode_stream"):
            decoder.byte_pieces = None
    return decoder


def main(argv: list[str]) -> int:
    rfd, wfd = int(argv[1]), int(argv[2])
    m.widen_pipe(rfd)
    try:
        return StandaloneOutput(rfd, wfd).run()
    except BrokenPipeError:
        return 0  # the engine process is gone: so is our reason to run


if __name__ == "__main__":
    sys.exit(main(sys.argv))
