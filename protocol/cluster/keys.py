"""The key names on a Redis Cluster (``ClusterKeys``): the single-Redis names of
``protocol/keys.py`` with hash tags, and ``keys_for``, which picks one or the other.

A key's hash tag (the part in braces) decides its slot: every key and channel of one
request carries the tag ``request_tag(id)``, so each per-request script and pipeline stays
in one slot; the request streams are split into ``shards``, each shard's three lanes and
its dead letters sharing one tag placed in its own slot window
(``protocol/cluster/shard_slots.py``),
so the shards spread over the masters; the fleet-wide keys (heartbeats, restarts) share
the tag ``{prefix}``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from redis.crc import key_slot

from protocol.cluster.shard_slots import (
    DEFAULT_SHARDS,
    MAX_SHARDS,
    shard_by_range,
    shard_tag,
    slot_range,
)
from protocol.keys import DEFAULT_PREFIX, Keys


def request_tag(request_id: str) -> str:
    """The hash tag every key and channel of one request carries in cluster mode.

    The one place that decides which slot a request's state lives in: the job hash, the
    replay log, the cancel mark and the token channel all hash to this tag's slot, so the
    scripts that touch several of them run on one node. (Request ids cannot contain
    braces: ``protocol.models.ID_PATTERN``.)"""
    return "{" + request_id + "}"


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
    * per served model: the tokenizer's request list and replies,
      ``ferry:tokenizer:{<model>}`` and ``ferry:tokenizer:{<model>}:reply:<id>``, named
      as in ``Keys`` (tagged there already: one slot per model).
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
        return shard_by_range(self.shards)[slot_range(key_slot(request_id.encode()),
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
    def handbacks(self) -> str:
        return f"{self.prefix}:handbacks:{self.global_tag}"

    @property
    def restarts(self) -> str:
        return f"{self.prefix}:restarts:{self.global_tag}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{self.global_tag}:{worker_id}"

    def affinity(self, worker_id: str) -> str:
        return f"{self.prefix}:affinity:{self.global_tag}:{worker_id}"

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
