"""The tokenizer responder: threads that pop the gateway's tokenizer requests from Redis
and answer them, off the engine loop.

The gateway has no tokenizer; for ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` it
pushes a ``TokenizerRequest`` onto its tenant's list for the model this worker serves and
rings a bell (``protocol/tokenizer_queue.py``). Each responder thread BLPOPs a bell on a
connection of its own (one second at a time, so a stop is noticed, and a pop after each
idle second), then pops the next call of the tenants in turn (``POP_LUA``: round robin, one
call per tenant), answers with the engine's ``PromptBuilder`` (``tokenizer_answers.py``;
each thread tokenizes with its own copy of the tokenizer) and pushes the reply onto the
reply key, with a TTL that ends shortly after the caller's deadline. Every worker of the
model blocks on the same bells, so whichever is free takes the next call; the engine loop
never sees any of it (tokenizing holds the GIL only in part: the Rust tokenizer lets it go
while it encodes, not while Python turns ids into lists).

With two threads or more, the last one takes only small calls (``SMALL_BYTES``, BLPOPing
their bell): one tenant's flood of 400k-character calls keeps at most the others busy, so
another tenant's short call is answered at once, and the flood's share of the worker's CPU
is that of one thread, at a lower priority than generation's (``NICE``; measured:
``ops/bench/tenants/tokenizer_flood.py``, docs/service.md). A call
popped past its deadline (the gateway stopped waiting) is dropped unanswered, as is a reply
finished past it; a reply over ``MAX_REPLY_BYTES`` is a 400 naming the input instead.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any

import structlog
from jinja2 import TemplateError

from protocol.codec import ProtocolError
from protocol.tokenizer import (
    MAX_REPLY_BYTES,
    REPLY_TTL_S,
    TokenizerReply,
    TokenizerRequest,
    decode_tokenizer_request,
    encode_tokenizer_message,
)
from protocol.tokenizer_queue import BELL, POP_LUA, payload_of, pop_args, small_bell_key
from worker.engine import LoraManager, PromptBuilder
from worker.service.redis.connection import TRANSIENT_ERRORS, WorkerSettings, recover
from worker.service.redis.read_loop import read_until_stopped
from worker.service.sidecars.tokenizer_answers import answer

log = structlog.get_logger("ferry.worker.tokenizer")

POLL_S = 1.0  # BLPOP timeout: how long a stop may wait for a thread to notice it
REPLY_ATTEMPTS = 3  # a reply that Redis refused is retried this often, then dropped
REPLY_GRACE_S = 2  # a reply's TTL: until this long after the caller's deadline
NICE = 10
"""The responder threads' scheduling priority (Linux's per-thread nice): generation is the
worker's job, so when the CPU is short its threads come first. Measured with one tenant's
flood of 395k-character calls (``ops/bench/tenants/tokenizer_flood.py``): another tenant's
generation p50 0.14 s, as without the flood; 0.33 s at the default priority."""


class TokenizerResponder:
    """``start()``, then ``stop()``: ``threads`` threads answering ``settings.model_name``'s
    tokenizer requests with ``prompts`` (``tokenizer`` for ``/tokenizer_info``); with two or
    more, the last takes only small calls."""

    def __init__(self, settings: WorkerSettings, prompts: PromptBuilder, tokenizer: Any,
                 threads: int = 2, lora: LoraManager | None = None) -> None:
        self.settings = settings
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.lora = lora  # answers check_lora (an adapter checked, never registered here)
        self.model = settings.model_name
        self.key = settings.keys.tokenizer_requests(self.model)
        self.answered = 0  # replies sent (for tests and logs; += under the GIL)
        self._stop = threading.Event()
        self._threads = [threading.Thread(
            target=self._serve, args=(threads > 1 and i == threads - 1,),
            name=f"ferry-tokenizer-{i}", daemon=True) for i in range(threads)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = POLL_S + 2.0) -> None:
        """Stop taking requests; a request being answered is answered first."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self, small_only: bool) -> None:
        _yield_cpu()
        read_until_stopped(self.settings, self._stop, lambda r: self._take(r, small_only),
                           self._on_pop, log, "tokenizer_redis_unavailable")

    def _take(self, r: Any, small_only: bool) -> bytes | None:
        """The next call to answer: after a bell (or an idle poll), the tenants' next in
        turn (only a small one for a ``small_only`` thread); None if there is none."""
        rung = r.blpop([small_bell_key(self.key) if small_only else self.key],
                       timeout=POLL_S)
        if rung is not None and bytes(rung[1]) != BELL:
            return bytes(rung[1])  # a call an older producer pushed onto the bell list
        keys, args = pop_args(self.key, small_only)
        raw = r.eval(POP_LUA, len(keys), *keys, *args)
        return None if raw is None else payload_of(bytes(raw))

    def _on_pop(self, r: Any, data: bytes | None) -> None:
        if data is not None:
            try:
                self._handle(r, data)
            except Exception:  # never let one request end the thread
                log.exception("tokenizer_request_failed")

    def _handle(self, r: Any, data: bytes) -> None:
        try:
            request = decode_tokenizer_request(data)
        except ProtocolError as exc:  # no reply id to answer on: the producer's bug
            log.warning("bad_tokenizer_request", error=str(exc))
            return
        if time.time() > request.deadline:
            log.info("tokenizer_request_expired", op=request.op, reply_id=request.reply_id)
            return
        payload = self._answer(request)
        if time.time() > request.deadline:  # nobody waits for it any more
            log.info("tokenizer_answer_late", op=request.op, reply_id=request.reply_id)
            return
        ttl = min(REPLY_TTL_S, math.ceil(request.deadline - time.time()) + REPLY_GRACE_S)
        self._send(r, self.settings.keys.tokenizer_reply(self.model, request.reply_id),
                   payload, ttl)

    def _answer(self, request: TokenizerRequest) -> bytes:
        """The reply's msgpack bytes: the answer, or a refusal naming the field."""
        try:
            payload = encode_tokenizer_message(answer(request, self.prompts, self.tokenizer,
                                                      self.lora))
        except TemplateError as exc:  # a chat template refusing the messages
            payload = encode_tokenizer_message(TokenizerReply(
                status=400, error=f"messages: {exc}", param="messages"))
        except Exception as exc:  # a tokenizer bug fails the request, never the thread
            log.exception("tokenizer_request_failed", op=request.op)
            payload = encode_tokenizer_message(TokenizerReply(
                status=500, error=f"internal error: {type(exc).__name__}"))
        if len(payload) <= MAX_REPLY_BYTES:
            return payload
        field = next((f for f in ("prompt", "messages", "tokens") if getattr(request, f)
                      is not None), "model")
        return encode_tokenizer_message(TokenizerReply(status=400, param=field, error=(
            f"{field}: the answer would be {len(payload)} bytes, more than a tokenizer "
            f"reply may carry ({MAX_REPLY_BYTES}); send a shorter input")))

    def _send(self, r: Any, key: str, payload: bytes, ttl_s: int) -> None:
        for attempt in range(REPLY_ATTEMPTS):
            try:
                pipe = r.pipeline(transaction=False)
                pipe.rpush(key, payload)
                pipe.expire(key, max(1, ttl_s))
                pipe.execute()
                self.answered += 1
                return
            except TRANSIENT_ERRORS as exc:
                log.warning("tokenizer_reply_failed", attempt=attempt + 1, error=str(exc))
                recover(r)
                time.sleep(0.05 * (attempt + 1))
        log.error("tokenizer_reply_dropped", key=key)


def _yield_cpu() -> None:
    """Lower this thread's priority by ``NICE`` where threads have one of their own (Linux;
    elsewhere ``setpriority`` of a thread id could name another process)."""
    if sys.platform != "linux":
        return
    me = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + NICE))
    except OSError as exc:  # never a reason not to answer
        log.warning("tokenizer_nice_failed", error=str(exc))
