"""The intake's reads of the fair backlogs: which lane stream to pull from, how many at a
time, and how to wait when every backlog is empty (``protocol/tenants/fair.py``).

On one Redis a lane is one stream: the pull asks for the whole room at once, in the order
the shared counters decide. On a Redis Cluster each shard keeps its own counters, so
taking a whole room from one shard would hand that shard's second-fairest request out
before the other shards' fairest: the reader takes one entry per shard in turn (round
robin, from the pass's rotating first shard) until the room is filled or every shard of
the lane is empty. The tenant with the lowest counter on each shard so gets its turn
before anyone's second, and the per-shard shares add up to a fleet-wide one. A shard
that cannot be reached is skipped until it answers again (``shard_gate.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.cluster.nodes import node_client
from protocol.tenants import fair
from worker.service.redis.connection import WorkerSettings
from worker.service.redis.shard_gate import ShardGate

Process = Callable[[str, list[Any]], None]


class FairReader:
    """Pulls for one worker; ``marks`` collects where each pulled stream and bell ended,
    so a later wait misses no push that came after the pull."""

    def __init__(self, settings: WorkerSettings, redis: Any, gate: ShardGate | None = None
                 ) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = redis
        self.gate = gate or ShardGate(settings)
        self.marks: dict[str, Any] = {}
        # ms until the soonest request a pull passed over (offered to another worker by
        # prefix affinity) may be taken here; -1: none. Bounds the next wait, so a steal
        # happens on time even when no push rings a bell.
        self.soonest_ms = -1

    def pull_lane(self, lane: list[str], rooms: dict[str, int], taken: int,
                  process: Process) -> int:
        """Entries taken from one lane's streams (in the order given), each batch handed
        to ``process``; stops when ``rooms[stream] - taken`` is used up. A stream whose
        shard is lost, or is lost now, is left out (``shard_gate.py``)."""
        got, open_ = 0, list(lane)
        while open_:
            for stream in list(open_):
                room = rooms[stream] - taken - got
                if room <= 0:
                    return got
                want = room if len(lane) == 1 else 1
                n = self.gate.run(self.gate.shard_of_stream(stream), self._pull, stream, want,
                                  process, default=-1, redis=self.redis)
                got += max(0, n)
                if n < want:
                    open_.remove(stream)
        return got

    def _pull(self, stream: str, want: int, process: Process) -> int:
        entries, (bell_id, last_id), soonest = fair.pull_marked(
            self.redis, stream, self.keys.group, self.settings.worker_id, want)
        self.marks[fair.bell(stream)], self.marks[stream] = bell_id, last_id
        if soonest >= 0 and (self.soonest_ms < 0 or soonest < self.soonest_ms):
            self.soonest_ms = soonest
        if entries:
            process(stream, entries)
        return len(entries)

    def wait(self, shard: int, rooms: dict[str, int], busy: bool) -> None:
        """Nothing to pull: BLOCK until a producer rings a lane's bell (a push onto its
        fair backlog) or XADDs straight into it, from where the pulls left them. One shard
        (a read spans one slot): on a cluster briefly, then the next pass tries the next."""
        watched = {name: self.marks[name] for stream in self.keys.shard_streams(shard)
                   if rooms.get(stream, 0) > 0 and stream in self.marks
                   for name in (fair.bell(stream), stream)}
        self.marks = {}
        soonest, self.soonest_ms = self.soonest_ms, -1
        if not watched:
            return
        block = self.settings.busy_block_ms if busy else self.settings.idle_block_ms
        if self.keys.shards > 1:
            block = min(block, self.settings.busy_block_ms)
        if soonest >= 0:  # wake when a request offered to another may be taken here
            block = max(1, min(block, soonest + 1))
        self.gate.run(shard, self._block, watched, block, default=None, redis=self.redis)

    def _block(self, watched: dict[str, Any], block: int) -> None:
        # on the shard's master itself: redis-py would ask its default node for XREAD's
        # keys first, which may be the master of a lost shard
        node_client(self.redis, next(iter(watched))).xread(watched, count=1, block=block)
