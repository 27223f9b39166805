"""A scripted stand-in for the worker, for unit tests of the client and the gateway.

It speaks the real Redis contract through ``protocol.store`` (XREADGROUP, start_job,
PUBLISH + RPUSH per event, result hash, XACK, dead-letter), but instead of a model it
replies with a fixed script of tokens. Integration tests use the real worker instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import redis

from protocol.codec import ProtocolError, decode_entry
from protocol.dead_letters import dead_letter
from protocol.keys import Keys
from protocol.models import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    JobStatus,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerHeartbeat,
    state_for_finish,
)
from protocol.store import Ttls, ensure_group, finish, push_event, start_job
from protocol.store import write_heartbeat as queue_heartbeat
from protocol.tenants import fair


@dataclass
class Script:
    """What the fake worker answers to every request."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world"])
    finish_reason: FinishReason = "stop"
    error: str | None = None
    error_kind: ErrorKind | None = None
    delay_s: float = 0.0
    hang_after: int | None = None  # emit this many tokens, then wait for a cancel
    error_code: str | None = None
    error_param: str | None = None
    stop_reason: str | int | None = None  # on the terminal event, with finish_reason "stop"


def _logprobs(request: GenerateRequest, token_id: int, text: str) -> list[TokenLogprob] | None:
    """A made-up logprob per token when the request asks (alternatives: two more ids)."""
    n = request.params.logprobs
    if n is None:
        return None
    top = [TopLogprob(token_id=token_id + k, logprob=-0.5 - k, token=f"{text}{k}")
           for k in range(n)]
    return [TokenLogprob(token_id=token_id, logprob=-0.5, token=text, top=top)]


class FakeWorker(threading.Thread):
    """Consumes the requests stream in the consumer group until ``stop()``."""

    def __init__(
        self,
        url: str,
        script: Script | None = None,
        keys: Keys | None = None,
        worker_id: str = "fake-worker",
        model: str = "fake-model",
        ttls: Ttls | None = None,
    ) -> None:
        super().__init__(daemon=True, name=f"fake-worker-{worker_id}")
        self.redis = redis.Redis.from_url(url)
        self.script = script or Script()
        self.keys = keys or Keys()
        self._stream = self.keys.requests
        self.worker_id = worker_id
        self.model = model
        self.ttls = ttls or Ttls(heartbeat_s=5)
        self.seen: list[GenerateRequest] = []
        self.dead: list[str] = []
        self._stop_flag = threading.Event()

    def __enter__(self) -> FakeWorker:
        ensure_group(self.redis, self.keys)
        self.heartbeat()
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(timeout=10)
        self.redis.close()

    def heartbeat(self) -> None:
        now = time.time()
        beat = WorkerHeartbeat(
            worker_id=self.worker_id, model=self.model, started_at=now, updated_at=now
        )
        pipe = self.redis.pipeline()
        queue_heartbeat(pipe, self.keys, beat, self.ttls)
        pipe.execute()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            self.heartbeat()
            taken = 0
            for stream in self.keys.request_streams:  # the fair pull, as a worker does
                entries, _marks = fair.pull(self.redis, stream, self.keys.group,
                                            self.worker_id, 8)
                self._stream = stream  # the lane of the entries served next
                for entry_id, fields in entries:
                    self._serve(entry_id, fields)
                taken += len(entries)
            if not taken:
                time.sleep(0.02)

    def _serve(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode_entry(fields)
        except ProtocolError as exc:
            self.dead.append(str(exc))
            pipe = self.redis.pipeline()
            dead_letter(pipe, self.keys, entry_id, fields, str(exc), self._stream)
            pipe.execute()
            return
        self.seen.append(request)
        decision = start_job(self.redis, self.keys, request.request_id, self.worker_id, self.ttls,
                             entry_id=entry_id, stream=self._stream,
                             origin=fields.get(b"origin", b"").decode())
        if decision in ("skip", "duplicate"):
            self.redis.xack(self._stream, self.keys.group, entry_id)
        elif decision == "cancel":
            self._finish(request, entry_id, [], "cancelled")
        else:
            self._generate(request, entry_id)

    def _cancelled(self, request: GenerateRequest) -> bool:
        return bool(self.redis.exists(self.keys.cancelled(request.request_id)))

    def _generate(self, request: GenerateRequest, entry_id: bytes) -> None:
        script, sent = self.script, []
        for i, text in enumerate(script.tokens[:-1] if script.tokens else []):
            if script.hang_after is not None and i >= script.hang_after:
                while not self._cancelled(request) and not self._stop_flag.is_set():
                    time.sleep(0.02)
            if self._cancelled(request):
                self._finish(request, entry_id, sent, "cancelled")
                return
            event = TokenEvent(request_id=request.request_id, seq=i, token_ids=[i + 1], text=text,
                               logprobs=_logprobs(request, i + 1, text),
                               prompt_tokens=3 if i == 0 else None)
            pipe = self.redis.pipeline()
            push_event(pipe, self.keys, event, self.ttls)
            pipe.execute()
            sent.append(event)
            time.sleep(script.delay_s)
        self._finish(request, entry_id, sent, script.finish_reason)

    def _finish(
        self, request: GenerateRequest, entry_id: bytes, sent: list[TokenEvent],
        reason: FinishReason,
    ) -> None:
        script, seq = self.script, len(sent)
        last = script.tokens[-1:] if reason not in ("cancelled", "error") else []
        tokens = [t.token_ids[0] for t in sent] + ([seq + 1] if last else [])
        usage = Usage(prompt_tokens=3, completion_tokens=len(tokens), total_tokens=3 + len(tokens))
        event = TokenEvent(
            request_id=request.request_id, seq=seq, token_ids=[seq + 1] if last else [],
            text="".join(last), finish_reason=reason, usage=usage, worker_id=self.worker_id,
            logprobs=_logprobs(request, seq + 1, last[0]) if last else None,
            error=script.error if reason == "error" else None,
            error_kind=script.error_kind if reason == "error" else None,
            error_code=script.error_code if reason == "error" else None,
            error_param=script.error_param if reason == "error" else None,
            stop_reason=script.stop_reason if reason == "stop" else None,
            timings=Timings(queued_s=0.0, ttft_s=0.01, total_s=0.02),
        )
        status = JobStatus(
            request_id=request.request_id, state=state_for_finish(reason),
            text="".join(e.text for e in sent) + event.text, token_ids=tokens,
            finish_reason=reason, usage=usage, error=event.error, error_kind=event.error_kind,
            worker_id=self.worker_id, created_at=request.created_at, finished_at=time.time(),
        )
        pipe = self.redis.pipeline()
        finish(pipe, self.keys, event, status, entry_id, self.ttls, self._stream)
        pipe.execute()
