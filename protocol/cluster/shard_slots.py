"""Where the request-stream shards live on a Redis Cluster: the slot math behind
``ClusterKeys`` (``protocol/keys.py``).

A shard's tag is placed in its own slot window so that, for any number of shards S <= 17,
the first S shards fall in S different slot ranges of the split ``redis-cli --cluster
create`` makes: the shards spread evenly over the masters, and a shard keeps its name when
S grows.
"""

from __future__ import annotations

import functools

from redis.crc import key_slot

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


def slot_range(slot: int, masters: int) -> int:
    """Which of the ``masters`` slot ranges holds ``slot``."""
    return next(j for j, (_, last) in enumerate(slot_ranges(masters)) if slot <= last)


@functools.lru_cache(maxsize=MAX_SHARDS)
def shard_by_range(shards: int) -> tuple[int, ...]:
    """For S shards: which shard's window lies in each of the S slot ranges."""
    owner = {slot_range(SHARD_SLOT_WINDOWS[k][0], shards): k for k in range(shards)}
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
