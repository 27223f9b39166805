"""The tokenizer responder: threads that pop the gateway's tokenizer requests from Redis
and answer them, off the engine loop.

The gateway has no tokenizer; for ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` it
pushes a ``TokenizerRequest`` onto the list of the model this worker serves
(``Keys.tokenizer_requests``). Each responder thread BLPOPs that list on a connection of
its own (one second at a time, so a stop is noticed), answers with the engine's
``PromptBuilder`` (``tokenizer_answers.py``; each thread tokenizes with its own copy of the
tokenizer) and pushes the reply onto the reply key with a short TTL. Every worker of the
model blocks on the same list, so whichever is free takes the next request; the engine
loop never sees any of it. A request popped past its deadline (the gateway stopped
waiting) is dropped unanswered.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog
from jinja2 import TemplateError

from protocol.codec import ProtocolError
from protocol.tokenizer import (
    REPLY_TTL_S,
    TokenizerReply,
    decode_tokenizer_request,
    encode_tokenizer_message,
)
from worker.engine.inputs.prompts import PromptBuilder
from worker.engine.lora.manager import LoraManager
from worker.service.redis.connection import TRANSIENT_ERRORS, WorkerSettings, recover
from worker.service.redis.read_loop import read_until_stopped
from worker.service.sidecars.tokenizer_answers import answer

log = structlog.get_logger("ferry.worker.tokenizer")

POLL_S = 1.0  # BLPOP timeout: how long a stop may wait for a thread to notice it
REPLY_ATTEMPTS = 3  # a reply that Redis refused is retried this often, then dropped


class TokenizerResponder:
    """``start()``, then ``stop()``: ``threads`` threads answering ``settings.model_name``'s
    tokenizer requests with ``prompts`` (``tokenizer`` for ``/tokenizer_info``)."""

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
        self._threads = [threading.Thread(target=self._serve, name=f"ferry-tokenizer-{i}",
                                          daemon=True) for i in range(threads)]

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

    def _serve(self) -> None:
        read_until_stopped(self.settings, self._stop,
                           lambda r: r.blpop([self.key], timeout=POLL_S), self._on_pop, log,
                           "tokenizer_redis_unavailable")

    def _on_pop(self, r: Any, popped: Any) -> None:
        if popped is not None:
            try:
                self._handle(r, popped[1])
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
        self._send(r, self.settings.keys.tokenizer_reply(self.model, request.reply_id),
                   payload)

    def _send(self, r: Any, key: str, payload: bytes) -> None:
        for attempt in range(REPLY_ATTEMPTS):
            try:
                pipe = r.pipeline(transaction=False)
                pipe.rpush(key, payload)
                pipe.expire(key, REPLY_TTL_S)
                pipe.execute()
                self.answered += 1
                return
            except TRANSIENT_ERRORS as exc:
                log.warning("tokenizer_reply_failed", attempt=attempt + 1, error=str(exc))
                recover(r)
                time.sleep(0.05 * (attempt + 1))
        log.error("tokenizer_reply_dropped", key=key)
