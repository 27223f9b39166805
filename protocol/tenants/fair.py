"""The fair backlog: a weighted fair share of every lane for every tenant, kept in Redis.

Producers do not XADD a request to its lane stream: they push it onto its tenant's *backlog*
for that lane (a LIST), and register the tenant in the lane's *ready* set (a ZSET scored by
the tenant's virtual token counter, as in VTC: "Fairness in Serving Large Language Models",
OSDI 2024). A worker pulls through one script (``PULL_LUA``, in ``fair_scripts.py`` with the
other worker-side Lua) that picks the ready tenant with the lowest counter, moves the head
of its backlog into the lane stream and XREADGROUPs it for the calling consumer, all
atomically: from then on the entry is an ordinary stream entry (PEL, leases, reaper and
takeover are unchanged). The counter is charged the request's prompt tokens
(``prompt_hint``) divided by its tenant's weight; the worker charges the rest of what it
really served (the generated tokens, and any error in the prompt estimate) when the request
ends (``CHARGE_LUA``). Charging the whole budget (prompt + ``max_tokens``) at the pull
instead would make a late tenant pay for tokens not yet served and alternate with a flooding
tenant's pulls, where VTC serves it at once. A tenant (re)entering the ready set starts at
max(its counter, the lowest ready counter) (or the floor the last tenant left at, if none is
ready; a thousandth of a token under it, so it wins a tie), so idle time banks no credit: a
late tenant with little work is served at once, a flooding one cannot starve the others, and
nothing idles while anyone waits.

Every worker pulls from the same keys, so the shares hold fleet-wide, not per worker. The
keys of one lane stream share its hash tag (``{stream}:fair:*``), so on a Redis Cluster
each shard keeps its own counters (see ``docs/tenants.md`` for how that composes).

Entries that an older producer XADDed straight into the lane stream are *adopted* by the
next pull: read, acknowledged, deleted, and pushed onto the default tenant's backlog,
tagged with their original entry id (``origin``), which ``START_JOB_LUA`` accepts as the
job's own entry. They are then served as the default tenant, in turn.

A backlog item is a fixed header, ``%012d`` cost then the origin id padded to 48
characters, followed by the msgpack request.
"""

from __future__ import annotations

import math
from typing import Any

from protocol.models import GenerateRequest
from protocol.tenants.fair_scripts import (
    CHARGE_LUA,
    LIFT_LUA,
    MAX_WEIGHT,
    MIN_WEIGHT,
    PULL_LUA,
)
from protocol.tenants.ids import DEFAULT_TENANT

DIRECT_COST = 64
"""What an adopted (directly XADDed) entry is charged up front; corrected when it ends."""

COST_FIELD = "cost"
ORIGIN_FIELD = "origin"
_HEADER = 12 + 48


def backlog(stream: str, tenant: str) -> str:
    """LIST: one tenant's requests waiting for this lane stream, oldest first."""
    return f"{stream}:fair:q:{tenant}"


def ready(stream: str) -> str:
    """ZSET: tenants with a non-empty backlog for this lane, scored by their counter."""
    return f"{stream}:fair:ready"


def counters(stream: str) -> str:
    """HASH: tenant -> virtual token counter (``:floor``: where the last leaver stood)."""
    return f"{stream}:fair:vtc"


def weights(stream: str) -> str:
    """HASH: tenant -> weight, as its latest producer declared it."""
    return f"{stream}:fair:w"


def bell(stream: str) -> str:
    """STREAM: one entry per request waiting in this lane's backlogs (the pull trims one
    per request it takes): its length is the backlog's depth (what KEDA's ``streamLength``
    and ``queue_lags`` read), and every push wakes the workers blocked on it."""
    return f"{stream}:fair:bell"


def fair_keys(stream: str) -> list[str]:
    """The keys of one lane's fair backlog that every script gets, in script order."""
    return [ready(stream), counters(stream), weights(stream), bell(stream)]


def check_weight(weight: float) -> float:
    """``weight`` as a float, or ValueError unless it is finite and within
    [``MIN_WEIGHT``, ``MAX_WEIGHT``]."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            MIN_WEIGHT <= weight <= MAX_WEIGHT):  # NaN fails every comparison
        raise ValueError(f"weight: {weight!r} must be a number from {MIN_WEIGHT:g} to "
                         f"{MAX_WEIGHT:g}")
    return float(weight)


def prompt_hint(request: GenerateRequest) -> int:
    """The prompt's tokens, known before any tokenizer runs: its token ids, or about four
    characters a token. What the fair pull charges (the prompt is served at once, by the
    prefill); the generated tokens are charged when they have been served."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.prompt is not None:
        prompt = math.ceil(len(request.prompt) / 4)
    else:
        prompt = math.ceil(sum(len(m.content) for m in request.messages or []) / 4)
    return max(1, prompt)


def cost_hint(request: GenerateRequest) -> int:
    """The tokens a request may cost at most: the prompt plus every candidate's
    ``max_tokens`` (what the ``tokens_per_minute`` quota counts at admission)."""
    return prompt_hint(request) + request.params.max_tokens * request.params.num_candidates


# The push, as a Lua fragment: KEYS[a..a+4] = ready, vtc, weights, bell, backlog;
# ARGV[b..b+3] = tenant, weight, cost, msgpack request.
PUSH_BODY = LIFT_LUA + """
local function push(a, b)
  local tenant = ARGV[b]
  redis.call('RPUSH', KEYS[a + 4], string.format('%012d%-48s', tonumber(ARGV[b + 2]), '')
             .. ARGV[b + 3])
  redis.call('HSET', KEYS[a + 2], tenant, ARGV[b + 1])
  lift(KEYS[a], KEYS[a + 1], tenant)
  redis.call('XADD', KEYS[a + 3], '*', 't', tenant)
end
"""

PUSH_LUA = PUSH_BODY + "push(1, 1)\nreturn 1\n"


def push_args(keys_stream: str, request: GenerateRequest, weight: float,
              payload: bytes) -> tuple[list[str], list[Any]]:
    """(KEYS, ARGV) of ``PUSH_LUA`` (or of ``push(a, b)`` inside a bigger script)."""
    tenant = request.tenant or DEFAULT_TENANT
    return ([*fair_keys(keys_stream), backlog(keys_stream, tenant)],
            [tenant, repr(check_weight(weight)), prompt_hint(request), payload])


def pull(r: Any, stream: str, group: str, consumer: str, count: int
         ) -> tuple[list[tuple[Any, dict[Any, Any]]], tuple[Any, Any]]:
    """Up to ``count`` entries for ``consumer`` from ``stream``'s fair backlog (sync
    client), as XREADGROUP would give them, and the (bell, stream) ids to block after."""
    entries, marks, _soonest = pull_marked(r, stream, group, consumer, count)
    return entries, marks


def pull_marked(r: Any, stream: str, group: str, consumer: str, count: int
                ) -> tuple[list[tuple[Any, dict[Any, Any]]], tuple[Any, Any], int]:
    """``pull``, plus the milliseconds until the soonest request this pull passed over
    (offered to another worker) may be taken by any worker (-1: none was passed over)."""
    reply = r.execute_command(
        "EVAL", PULL_LUA, 5, stream, ready(stream), counters(stream), weights(stream),
        bell(stream), group, consumer, count, DIRECT_COST, DEFAULT_TENANT,
        backlog(stream, ""))
    marks = (reply[0], reply[1])
    entries = []
    for i in range(3, len(reply), 2):
        flat = reply[i + 1]
        entries.append((reply[i], dict(zip(flat[::2], flat[1::2], strict=True))))
    return entries, marks, int(reply[2])


def queue_charge(pipe: Any, stream: str, tenant: str, tokens: int) -> None:
    """Queue adding ``tokens`` (divided by the tenant's weight) to its counter on a lane."""
    pipe.execute_command("EVAL", CHARGE_LUA, 3, counters(stream), ready(stream),
                         weights(stream), tenant, tokens)
