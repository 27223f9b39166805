"""Every Redis key, stream, consumer group and channel name Ferry uses, in one place.

All names share one prefix (default ``ferry``) so several deployments can share a Redis
and so ``SCAN MATCH ferry:*`` finds everything. Per-request names embed the request id,
which the protocol restricts to key-safe characters (see ``protocol.models.ID_PATTERN``).

``Keys`` names one Redis; ``ClusterKeys`` names the same things for a Redis Cluster, where
a key's *hash tag* (the part in braces) decides its slot: every key and channel of one
request carries the tag ``request_tag(id)``, so each per-request script and pipeline stays
in one slot; the request streams are split into ``shards``, each shard's three lanes and
its dead letters sharing one tag placed in its own slot window (``SHARD_SLOT_WINDOWS``),
so the shards spread over the masters; the fleet-wide keys (heartbeats, restarts) share
the tag ``{prefix}``.

The Batch API's names (files, batches) carry a hash tag already: every key of one file
shares ``{file id}``, every key of one batch ``{batch id}``, so the scripts that touch several
of them (``protocol/batches.py``) stay on one slot of a Redis Cluster; a single Redis just
ignores the braces.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import ClassVar

from redis.crc import key_slot

DEFAULT_PREFIX = "ferry"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

PRIORITY_BANDS = ("high", "normal", "low")
"""Request-stream lanes, in the order workers read them. A request's band follows from its
``priority`` (lower runs first): < 0 is ``high``, 0 is ``normal``, > 0 is ``low``."""


def _lane_index(band: str) -> int:
    if band not in PRIORITY_BANDS:
        raise ValueError(f"band: {band!r} is not one of {', '.join(PRIORITY_BANDS)}")
    return PRIORITY_BANDS.index(band)


def band_of(priority: int) -> str:
    """The lane of a request with this ``priority`` (see ``PRIORITY_BANDS``)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


@dataclass(frozen=True)
class Keys:
    """Name factory: ``Keys("ferry").job("abc") == "ferry:job:abc"``."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix: {self.prefix!r} must match {_PREFIX_RE.pattern}")

    # --- shared -------------------------------------------------------------------------
    @property
    def requests(self) -> str:
        """The ``normal`` lane: stream of msgpack GenerateRequests (field ``data``) of
        priority 0; never trimmed by producers. Its name predates the lanes."""
        return f"{self.prefix}:requests"

    def requests_band(self, band: str) -> str:
        """The request stream of one lane: ``{prefix}:requests:high``, ``{prefix}:requests``
        (normal), ``{prefix}:requests:low``."""
        _lane_index(band)
        return self.requests if band == "normal" else f"{self.requests}:{band}"

    def requests_for(self, priority: int) -> str:
        """The request stream a request of this ``priority`` is enqueued on."""
        return self.requests_band(band_of(priority))

    @property
    def request_streams(self) -> tuple[str, ...]:
        """Every lane's stream (of every shard), highest priority first: the order workers
        read them in."""
        return tuple(s for band in PRIORITY_BANDS for s in self.lane_streams(band))

    # --- shards (one here; ``ClusterKeys`` has several) ----------------------------------
    cluster: ClassVar[bool] = False

    @property
    def shards(self) -> int:
        """How many shards the request streams are split into."""
        return 1

    def shard_of(self, request_id: str) -> int:
        """The shard a request is enqueued on."""
        return 0

    def shard_streams(self, shard: int) -> tuple[str, ...]:
        """One shard's three lanes, highest priority first."""
        self._check_shard(shard)
        return tuple(self.requests_band(band) for band in PRIORITY_BANDS)

    def lane_streams(self, band: str) -> tuple[str, ...]:
        """One lane's stream on every shard, shard 0 first."""
        lane = _lane_index(band)
        return tuple(self.shard_streams(k)[lane] for k in range(self.shards))

    def stream_for(self, request_id: str, priority: int) -> str:
        """The stream a request with this id and ``priority`` is enqueued on."""
        return self.shard_streams(self.shard_of(request_id))[_lane_index(band_of(priority))]

    def dead_letter_for(self, stream: str) -> str:
        """Where entries of ``stream`` that no worker can run are moved."""
        return self.dead_letter

    @property
    def dead_letters(self) -> tuple[str, ...]:
        """Every dead-letter stream."""
        return (self.dead_letter,)

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard: {shard} is not in 0..{self.shards - 1}")

    @property
    def group(self) -> str:
        """The consumer group all workers read in; each lane's stream has one by this name."""
        return f"{self.prefix}-workers"

    @property
    def dead_letter(self) -> str:
        """Stream of entries no worker could decode or run, with the reason."""
        return f"{self.prefix}:requests:dead"

    @property
    def control(self) -> str:
        """Pub/sub channel for msgpack Cancel messages, heard by every worker."""
        return f"{self.prefix}:control"

    @property
    def workers(self) -> str:
        """Set of worker ids that have sent a heartbeat; stale members are pruned by readers."""
        return f"{self.prefix}:workers"

    @property
    def restarts(self) -> str:
        """HASH of process restarts recorded by ``ferry up``'s supervisor (for ``ferry top``):
        field ``{launcher}/{process}``, value a JSON record (``ferry/recovery.py``); TTL."""
        return f"{self.prefix}:restarts"

    # --- per request --------------------------------------------------------------------
    def tokens(self, request_id: str) -> str:
        """Pub/sub channel carrying the request's msgpack TokenEvents."""
        return f"{self.prefix}:tokens:{request_id}"

    def events(self, request_id: str) -> str:
        """LIST replaying the same TokenEvents: element i is the event with seq i (TTL)."""
        return f"{self.prefix}:events:{request_id}"

    def job(self, request_id: str) -> str:
        """HASH with the job's state and, once finished, its result (TTL)."""
        return f"{self.prefix}:job:{request_id}"

    def cancelled(self, request_id: str) -> str:
        """STRING (the reason) marking a request cancelled, so a worker skips it (TTL)."""
        return f"{self.prefix}:cancelled:{request_id}"

    # --- per worker ---------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        """STRING holding the worker's msgpack WorkerHeartbeat; its TTL is its liveness."""
        return f"{self.prefix}:worker:{worker_id}"

    # --- Batch API: one hash tag per file and per batch ------------------------------------
    def file(self, file_id: str) -> str:
        """HASH: one file's record (owner, purpose, bytes, lines, ...) (TTL)."""
        return f"{self.prefix}:file:{{{file_id}}}"

    def file_lines(self, file_id: str) -> str:
        """LIST: an uploaded file's raw lines, each with its line ending (same TTL)."""
        return f"{self.prefix}:file:{{{file_id}}}:lines"

    def files_of(self, owner: str) -> str:
        """ZSET (all scores 0, ids in time order): the files of one owner, for listing."""
        return f"{self.prefix}:files:{{{owner}}}"

    def batch(self, batch_id: str) -> str:
        """HASH: one batch's record, status, counts and feeding cursor (TTL once ended)."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_output(self, batch_id: str) -> str:
        """HASH: line index -> the line's result (JSON), for the lines that succeeded."""
        return f"{self.prefix}:batch:{{{batch_id}}}:output"

    def batch_errors(self, batch_id: str) -> str:
        """HASH: line index -> the line's error result (JSON), for every other line."""
        return f"{self.prefix}:batch:{{{batch_id}}}:errors"

    def batch_inflight(self, batch_id: str) -> str:
        """SET: indexes of lines enqueued whose result is not recorded yet."""
        return f"{self.prefix}:batch:{{{batch_id}}}:inflight"

    def batch_lease(self, batch_id: str) -> str:
        """STRING: the id of the batcher driving this batch; its TTL is the lease."""
        return f"{self.prefix}:batch:{{{batch_id}}}:lease"

    def batches_of(self, owner: str) -> str:
        """ZSET (all scores 0, ids in time order): the batches of one owner, for listing."""
        return f"{self.prefix}:batches:{{{owner}}}"

    @property
    def batches_active(self) -> str:
        """ZSET (all scores 0): batches not yet ended, which batchers look for work in."""
        return f"{self.prefix}:batches:active"

# --- Redis Cluster ---------------------------------------------------------------------

def request_tag(request_id: str) -> str:
    """The hash tag every key and channel of one request carries in cluster mode.

    The one place that decides which slot a request's state lives in: the job hash, the
    replay log, the cancel mark and the token channel all hash to this tag's slot, so the
    scripts that touch several of them run on one node. (Request ids cannot contain
    braces: ``protocol.models.ID_PATTERN``.)"""
    return "{" + request_id + "}"


SLOTS = 16384
MAX_SHARDS = 17
DEFAULT_SHARDS = 3

SHARD_SLOT_WINDOWS: tuple[tuple[int, int], ...] = (
    (15420, 16383), (7447, 7561), (2341, 2520), (11916, 12014), (4681, 4818),
    (9362, 9556), (1170, 1259), (14043, 14198), (6144, 6301), (10601, 10922),
    (3511, 3780), (12873, 13106), (8192, 8673), (0, 963), (14456, 15291),
    (5120, 5782), (9638, 10600),
)
"""Slot window of shard k's tag (inclusive). For every S <= 17 the first S windows lie in S
different slot ranges of the split ``redis-cli --cluster create`` makes for S masters, so
with M masters and S a multiple of M every master holds S / M shards whatever S is, and a
shard keeps its name (and place) when S grows. (Steinhaus' problem: no such sequence has
18 points; found by a small search, checked by ``tests/protocol/test_protocol_keys.py``.)"""


@functools.lru_cache(maxsize=64)
def slot_ranges(masters: int) -> tuple[tuple[int, int], ...]:
    """The slot ranges (inclusive) ``redis-cli --cluster create`` gives ``masters`` masters."""
    per, first, cursor, out = SLOTS / masters, 0, 0.0, []
    for j in range(masters):
        last = SLOTS - 1 if j == masters - 1 else round(cursor + per - 1)
        out.append((first, last))
        first, cursor = last + 1, cursor + per
    return tuple(out)


def _slot_range(slot: int, masters: int) -> int:
    return next(j for j, (_, last) in enumerate(slot_ranges(masters)) if slot <= last)


@functools.lru_cache(maxsize=MAX_SHARDS)
def _shard_by_range(shards: int) -> tuple[int, ...]:
    """For S shards: which shard's window lies in each of the S slot ranges."""
    owner = {_slot_range(SHARD_SLOT_WINDOWS[k][0], shards): k for k in range(shards)}
    return tuple(owner[j] for j in range(shards))


@functools.lru_cache(maxsize=256)
def shard_tag(prefix: str, shard: int) -> str:
    """``{prefix.s<k>.<n>}``: the first n whose slot lies in shard k's window."""
    low, high = SHARD_SLOT_WINDOWS[shard]
    for n in range(SLOTS * 64):
        tag = f"{prefix}.s{shard}.{n}"
        if low <= key_slot(tag.encode()) <= high:
            return "{" + tag + "}"
    raise RuntimeError(f"no tag found for shard {shard}")  # pragma: no cover


@dataclass(frozen=True)
class ClusterKeys(Keys):
    """The names for a Redis Cluster: the single-Redis names with a hash tag.

    * per request: ``ferry:job:{id}``, ``ferry:events:{id}``, ``ferry:tokens:{id}`` (a
      sharded pub/sub channel), ``ferry:cancelled:{id}``;
    * shard k: ``ferry:requests:high:{ferry.s<k>.<n>}``, ``ferry:requests:{...}``,
      ``ferry:requests:low:{...}`` and its dead letters ``ferry:requests:dead:{...}``;
    * fleet-wide: ``ferry:workers:{ferry}``, ``ferry:worker:{ferry}:<id>``,
      ``ferry:restarts:{ferry}``; the control channel stays ``ferry:control`` (classic
      pub/sub, which a cluster broadcasts to every node: cancels are rare).
    """

    shards: int = DEFAULT_SHARDS  # type: ignore[assignment]  # a field here, 1 in Keys
    cluster: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards: {self.shards} is not in 1..{MAX_SHARDS}")

    def shard_of(self, request_id: str) -> int:
        """The shard whose window shares a slot range with the request's own slot (of the
        S ranges ``redis-cli`` would give S masters): uniform over shards, and with an even
        split of slots over M masters (S a multiple of M) the request's stream is on the
        master that also holds its keys."""
        return _shard_by_range(self.shards)[_slot_range(key_slot(request_id.encode()),
                                                         self.shards)]

    def shard_streams(self, shard: int) -> tuple[str, ...]:
        self._check_shard(shard)
        tag = shard_tag(self.prefix, shard)
        return (f"{self.prefix}:requests:high:{tag}", f"{self.prefix}:requests:{tag}",
                f"{self.prefix}:requests:low:{tag}")

    @functools.cached_property
    def _shard_by_stream(self) -> dict[str, int]:
        return {s: k for k in range(self.shards) for s in self.shard_streams(k)}

    def shard_of_stream(self, stream: str) -> int:
        try:
            return self._shard_by_stream[stream]
        except KeyError:
            raise ValueError(f"stream: {stream!r} is not a request stream") from None

    def dead_letter_for(self, stream: str) -> str:
        return f"{self.prefix}:requests:dead:{shard_tag(self.prefix, self.shard_of_stream(stream))}"

    @property
    def dead_letters(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}:requests:dead:{shard_tag(self.prefix, k)}"
                     for k in range(self.shards))

    @property
    def global_tag(self) -> str:
        return "{" + self.prefix + "}"

    # single-stream names have no meaning across shards: name the shard instead
    @property
    def requests(self) -> str:
        raise TypeError("ClusterKeys: the request streams are sharded; use stream_for, "
                        "shard_streams or lane_streams")

    def requests_band(self, band: str) -> str:
        raise TypeError("ClusterKeys: the request streams are sharded; use lane_streams")

    @property
    def dead_letter(self) -> str:
        raise TypeError("ClusterKeys: dead letters are per shard; use dead_letter_for")

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers:{self.global_tag}"

    @property
    def batches_active(self) -> str:
        return f"{self.prefix}:batches:active:{self.global_tag}"

    @property
    def restarts(self) -> str:
        return f"{self.prefix}:restarts:{self.global_tag}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{self.global_tag}:{worker_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}:tokens:{request_tag(request_id)}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_tag(request_id)}"

    def job(self, request_id: str) -> str:
        return f"{self.prefix}:job:{request_tag(request_id)}"

    def cancelled(self, request_id: str) -> str:
        return f"{self.prefix}:cancelled:{request_tag(request_id)}"


def keys_for(prefix: str = DEFAULT_PREFIX, cluster: bool = False,
             shards: int = DEFAULT_SHARDS) -> Keys:
    """The names of one deployment: ``ClusterKeys`` on a cluster, else ``Keys``."""
    return ClusterKeys(prefix, shards) if cluster else Keys(prefix)
