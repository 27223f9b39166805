"""Every Redis key, stream, consumer group and channel name Ferry uses, in one place.

All names share one prefix (default ``ferry``) so several deployments can share a Redis
and so ``SCAN MATCH ferry:*`` finds everything. Per-request names embed the request id,
which the protocol restricts to key-safe characters (see ``protocol.models.ID_PATTERN``).

``Keys`` names one Redis; ``ClusterKeys`` (``protocol/cluster/keys.py``) names the same
things for a Redis Cluster, with hash tags, and ``keys_for`` picks one or the other.

The tokenizer's request lists and replies carry the hash tag of their model
(``model_tag``), so a request and its reply share a slot of a Redis Cluster.

The Batch API's names (files, batches) carry a hash tag already: every key of one file
shares ``{file id}``, every key of one batch ``{batch id}``, so the scripts that touch several
of them (``protocol/batch/records.py``) stay on one slot of a Redis Cluster; a single Redis just
ignores the braces.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

DEFAULT_PREFIX = "ferry"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

PRIORITY_BANDS = ("high", "normal", "low")
"""Request-stream lanes, in the order workers read them. A request's band follows from its
``priority`` (lower runs first): < 0 is ``high``, 0 is ``normal``, > 0 is ``low``."""


def _lane_index(band: str) -> int:
    if band not in PRIORITY_BANDS:
        raise ValueError(f"band: {band!r} is not one of {', '.join(PRIORITY_BANDS)}")
    return PRIORITY_BANDS.index(band)


_MODEL_TAG_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")


def model_tag(model: str) -> str:
    """The hash tag of one served model's tokenizer keys: the name itself when it is short
    and brace-free (readable in ``SCAN``), else ``sha-`` and its SHA-256 prefix."""
    if _MODEL_TAG_RE.match(model):
        return model
    return "sha-" + hashlib.sha256(model.encode()).hexdigest()[:32]


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
    def handbacks(self) -> str:
        """Counter bumped whenever a dead consumer's entries are handed back: the other
        workers' reapers read it with their liveness scan and claim the entries at once
        instead of at their next scheduled pass."""
        return f"{self.prefix}:handbacks"

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

    def affinity(self, worker_id: str) -> str:
        """ZSET: the chunk hashes the worker's prefix cache holds, scored by when it last
        served them (``protocol/affinity/board.py``); bounded, expires with its heartbeat."""
        return f"{self.prefix}:affinity:{worker_id}"

    # --- tokenizer requests: one hash tag per served model ------------------------------
    def tokenizer_requests(self, model: str) -> str:
        """LIST: msgpack TokenizerRequests (``protocol/tokenizer.py``) for the workers that
        serve ``model``; any one of them pops and answers each (TTL, refreshed per push)."""
        return f"{self.prefix}:tokenizer:{{{model_tag(model)}}}"

    def lora_adapters(self, model: str) -> str:
        """HASH: the LoRA adapters registered for served model ``model``, fleet-wide: name ->
        JSON ``LoraRecord`` (``protocol/lora/registry.py``). Workers, including ones started later,
        load what it holds and drop what leaves it."""
        return f"{self.prefix}:lora:{{{model_tag(model)}}}:adapters"

    def lora_models(self) -> str:
        """SET: the served models that have (or had) registered LoRA adapters, so a gateway
        that knows no served model yet (none configured, no worker live) still finds the
        adapters a request names."""
        return f"{self.prefix}:lora:models"

    def tokenizer_reply(self, model: str, reply_id: str) -> str:
        """LIST: the one msgpack TokenizerReply to request ``reply_id`` (short TTL); in the
        slot of the model's request list."""
        return f"{self.prefix}:tokenizer:{{{model_tag(model)}}}:reply:{reply_id}"

    # --- speculative decoding: the fleet's store of recent outputs ------------------------
    def drafts(self, model: str) -> str:
        """STREAM of recent outputs of ``model`` (field ``t``: the tokens as little-endian
        int32, ``tenant``: whose they are, ``w``: the worker that produced them), capped by
        its writers and trimmed to the draft store's TTL, the key expiring a TTL after the
        last append; every worker of the model tails it into its draft store, each entry
        under its tenant only (``worker/service/sidecars/draft_feed.py``). One hash tag per model:
        the stream lives on one shard of a Redis Cluster."""
        return f"{self.prefix}:drafts:{{{model_tag(model)}}}"

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
