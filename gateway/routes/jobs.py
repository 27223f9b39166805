"""Jobs API: submit and walk away, poll or follow later, resume a stream, cancel.

Bodies show the caller's own job id and nothing of the fleet's insides: no worker id
(which is also its consumer name), no stream entry id.

Unlike the OpenAI routes, a job is detached from the HTTP exchange that created it: a
client leaving an event stream does not cancel it, and ``Last-Event-ID`` resumes exactly
after the last event it saw (event ids are the events' ``seq``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from gateway.admission import require_api_key
from gateway.body import parse_json, run_sized, validate
from gateway.errors import APIError, scrub_error, unavailable
from gateway.openai_api.schemas import JobCreate
from gateway.queue_client import QueueClient
from gateway.routes.openai import body_schema, get_queue, get_served
from gateway.sse import PING, EventStreamResponse, sse
from gateway.tenancy.principal import job_id as job_id_of
from gateway.tenancy.principal import scoped, tenant
from protocol.aclient import AsyncSubscription
from protocol.codec import ProtocolError
from protocol.lora.registry import public_name
from protocol.models import ID_PATTERN, GenerateRequest, JobStatus

router = APIRouter(prefix="/v1/jobs", dependencies=[Depends(require_api_key)])
_ID_RE = re.compile(ID_PATTERN)
_INTERNAL = {"worker_id"}
"""Fields of the job hash and its events that name the fleet's insides (which worker, i.e.
which consumer, ran it): kept in the logs, the hash itself and ``ferry top``, never shown
to callers. (The hash's ``entry_id`` and ``stream`` are not JobStatus fields at all.)"""


def _links(job_id: str) -> dict[str, str]:
    return {"status": f"/v1/jobs/{job_id}", "events": f"/v1/jobs/{job_id}/events"}


def _own(http: Request, job_id: str) -> str:
    """The Redis id of the caller's job ``job_id``: ids live in per-tenant namespaces, so
    another tenant's job is simply not found (404, never 403)."""
    rid = job_id_of(tenant(http), job_id)
    if rid is None:
        raise APIError(404, f"job: no job {job_id!r}", param="id")
    return rid


async def _status_or_404(queue: QueueClient, rid: str, job_id: str) -> JobStatus:
    status = await queue.client.result(rid)
    if status is None:
        raise APIError(404, f"job: no job {job_id!r} (unknown or expired)", param="id")
    return status


@router.post("", status_code=202, openapi_extra=body_schema(JobCreate))
async def create_job(http: Request, queue: QueueClient = Depends(get_queue)) -> JSONResponse:
    def prepare(raw: bytes) -> GenerateRequest:
        body = parse_json(raw, queue.settings.max_messages, queue.settings.max_prompt_chars)
        return validate(JobCreate, body).to_generate_request()

    plain = await run_sized(await http.body(), prepare)
    who = tenant(http)
    if plain.model is not None:  # an adapter travels as its registry key
        route = await get_served(http).route(plain.model, who)
        plain = plain.model_copy(update={"model": route.key})
    [request] = scoped(who, [plain])
    await queue.admit([request], who)
    await queue.enqueue(request)
    rid = plain.request_id
    body_out = {"id": rid, "object": "job", "state": "queued", "links": _links(rid)}
    return JSONResponse(body_out, status_code=202, headers={"Location": f"/v1/jobs/{rid}"})


@router.get("/{job_id}")
async def get_job(job_id: str, http: Request,
                  queue: QueueClient = Depends(get_queue)) -> dict[str, Any]:
    status = await _status_or_404(queue, _own(http, job_id), job_id)
    body = status.model_dump(mode="json", exclude=_INTERNAL)
    if status.model is not None:  # an adapter's registry key: the caller's name for it
        body["model"] = public_name(tenant(http).id, status.model)
    return {"id": job_id, "object": "job", **scrub_error(body), "request_id": job_id,
            "links": _links(job_id)}


@router.delete("/{job_id}", status_code=202)
async def cancel_job(job_id: str, http: Request,
                     queue: QueueClient = Depends(get_queue)) -> JSONResponse:
    """202 when the cancel took effect or was passed to the worker; 409 once the job has
    ended, however it ended (done, failed, timeout or cancelled): nothing is left to
    cancel, and a second DELETE gets the same answer as a DELETE of a finished job."""
    rid = _own(http, job_id)
    status = await _status_or_404(queue, rid, job_id)
    if status.is_terminal:
        raise APIError(409, f"job: {job_id!r} already ended ({status.state})", param="id")
    found = await queue.client.cancel(rid, reason="cancelled via API")
    if found not in ("cancelled", "running", "queued"):  # ended meanwhile, or expired
        raise APIError(409, f"job: {job_id!r} already ended ({found})", param="id")
    state = "cancelled" if found == "cancelled" else "cancelling"
    return JSONResponse({"id": job_id, "object": "job", "state": state}, status_code=202)


@router.get("/{job_id}/events", response_model=None)
async def job_events(
    job_id: str,
    http: Request,
    queue: QueueClient = Depends(get_queue),
    last_event_id: str | None = Header(default=None, alias="Last-Event-ID"),
    after: int | None = Query(default=None, ge=-1, description="Resume after this seq."),
) -> Response:
    """SSE of TokenEvents (``id:`` is the seq); ends after the terminal event.

    A position past the end of the log (no client can have seen such an event) resumes
    from the end: a finished job then sends its terminal event and closes at once; a
    running one follows from its latest event. A client that saw the terminal event gets
    204, which also stops EventSource from reconnecting."""
    rid = _own(http, job_id)
    after_seq = _after_seq(last_event_id, after)
    sub = await queue.open(rid)  # before reading the log: nothing published is missed
    try:
        status = await _status_or_404(queue, rid, job_id)
        last = int(await queue.client.redis.llen(queue.client.keys.events(rid))) - 1  # type: ignore[misc]
    except BaseException:
        await sub.close()
        raise
    if status.is_terminal and (last < 0 or after_seq == last):
        await sub.close()  # nothing more will come (or the log expired)
        return Response(status_code=204)
    if after_seq > last:
        after_seq = last - 1 if status.is_terminal else last
    sub.start_after(after_seq)
    deadline = time.monotonic() + queue.settings.request_timeout_s

    async def close() -> None:
        with contextlib.suppress(RedisError, OSError):
            await sub.close()

    return EventStreamResponse(_events(sub, queue, deadline, job_id), on_close=close)


_MAX_SEQ = 2**63 - 1  # what Redis list indices (and msgpack) can carry


def _after_seq(last_event_id: str | None, after: int | None) -> int:
    """The position to resume after; 400 naming the header or parameter if unusable."""
    if after is not None:
        name, value = "after", after
    elif last_event_id is None:
        return -1
    else:
        name = "Last-Event-ID"
        try:
            value = max(-1, int(last_event_id))
        except ValueError:
            raise APIError(400, "Last-Event-ID: must be an integer seq", param=name) from None
    if value > _MAX_SEQ:
        raise APIError(400, f"{name}: {value} is out of range (a seq is at most 2**63-1)",
                       param=name)
    return value


async def _events(sub: AsyncSubscription, queue: QueueClient, deadline: float,
                  job_id: str) -> AsyncIterator[bytes]:
    """Until the terminal event, or the deadline (the client may then resume); one write
    per wake-up with every event that was ready.

    A Redis outage ends the stream with an ``error`` event; resuming later loses nothing.
    """
    try:
        while not sub.finished:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = await sub.next_events(min(left, queue.settings.keepalive_s))
            yield b"".join(sse({**scrub_error(e.model_dump(mode="json", exclude_none=True,
                                                           exclude=_INTERNAL)),
                                "request_id": job_id}, event_id=e.seq)
                           for e in events) if events else PING
    except (RedisError, OSError, ProtocolError) as exc:
        yield sse(unavailable(exc, queue.settings.retry_after_s).body(), event="error")
