"""The standalone output process's Redis writes: each pass's ``TokenEvent``s, one script call.

What ``ops/bench/engine/host_step.py`` measures (the worker service's output process writes
through its ``Outbox`` instead: ``output_proc/service.py``). A pass that took several steps'
batches publishes one event per stream (``coalesce``). Every event is pushed to its
request's replay list, the list's TTL refreshed, and the event published on the request's
channel, in that order, per event in pass order: the writes a pipeline of three commands
per event made, made by one ``EVALSHA`` per pass (at most ``MAX_EVENTS`` events a call),
as the service's outbox does with its fenced push. redis-py spends ~10 us of Python per
pipelined command, which made Redis the output process's largest cost once its text got
cheap (``docs/service.md``).
"""

from __future__ import annotations

import dataclasses

import msgpack

from worker.engine import TextOutput

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
