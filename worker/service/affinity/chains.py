"""Where a request's chunks sit in the engine's prefix cache, and which chunk continues
which: what lets the book drop exactly the chunks whose blocks the cache let go.

A chunk hash (``protocol/affinity/chunks.py``) names text; the cache names token blocks,
each hash chained over its parent's. The worker knows both at admission: the request's
canonical text and its chunks (the intake, ``prefix_of``) and its prompt's tokens (the
engine). Chunk *k*'s text ends at character ``(k + 1) * CHUNK_CHARS``; in tokens, in
proportion, at ``that * tokens // characters`` (rounded down: it never claims a token the
chunk's text may not reach), so it ends in the full block holding its last token (the
prompt's partly filled last block has no hash yet: the block before it is taken). A chunk
is cached while every block up to the one it ends in is, since the cache reuses a chain
only up to its first missing block: ``block_owners`` gives each of those blocks to the
first chunk that needs it, and a block gone drops that chunk and every later chunk of the
same chain. Every block is watched, not only the blocks chunks end in, so the order in
which the cache lets a chain go does not matter (a full host tier drops a copy it has no
slot for, whichever block of the chain that is).

``ChunkChains`` keeps the two maps for the chunks the book holds: block hash -> the chunks
that need it first (one block can be needed by chunks of several chains: the same tokens
under two model names), and chunk -> the chunks that continue it. Chunks are rooted in
the cache partition and so are blocks: a tenant's block never names another tenant's
chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol.affinity.chunks import CHUNK_CHARS, canonical_text, scope_of, text_chunks
from protocol.models import GenerateRequest
from protocol.tenants.fair import prompt_hint


@dataclass(frozen=True)
class Prefix:
    """A request's chunks, as the intake computed them for the book."""

    chunks: list[str]
    text_chars: int  # the length of its canonical text
    weight: float  # each chunk's share of the prompt's tokens (the fair pull's estimate)


def prefix_of(request: GenerateRequest) -> Prefix | None:
    """The request's chunks (None: shorter than one chunk, nothing to book)."""
    text = canonical_text(request)
    chunks = text_chunks(text, scope_of(request))
    if not chunks:
        return None
    return Prefix(chunks, len(text), prompt_hint(request) / len(chunks))


def block_owners(prefix: Prefix, num_tokens: int, block_size: int) -> list[int]:
    """Per full prompt block from the first, up to the last one a chunk's text ends in,
    the index of the first chunk that needs it (empty: the prompt has no full block)."""
    if num_tokens < 1 or block_size < 1 or prefix.text_chars < 1:
        raise ValueError(f"block_owners needs tokens, a block size and text, got "
                         f"{num_tokens}, {block_size}, {prefix.text_chars}")
    last_full = num_tokens // block_size - 1
    owners: list[int] = []
    for k in range(len(prefix.chunks)):
        end = min((k + 1) * CHUNK_CHARS, prefix.text_chars) * num_tokens // prefix.text_chars
        ends_in = min((end - 1) // block_size, last_full)  # -1: no full block
        more = ends_in + 1 - len(owners)
        if more > 0 and not owners:  # block 0: every chunk needs it, the first owns it
            owners.append(0)
            more -= 1
        owners.extend([k] * more)
    return owners


class ChunkChains:
    """Block -> chunks needing it first, chunk -> chunks continuing it; only for chunks the
    book holds (it calls ``forget`` for each it drops). Not thread-safe: the book's lock
    covers it."""

    def __init__(self) -> None:
        self._needing: dict[bytes, set[str]] = {}  # block hash -> chunks needing it first
        self._needs: dict[str, set[bytes]] = {}  # chunk -> the block hashes it needs first
        self._next: dict[str, set[str]] = {}  # chunk -> the chunks continuing it
        self._prev: dict[str, str] = {}  # chunk -> the chunk it continues

    def add(self, chunks: Sequence[str], owned: Iterable[tuple[bytes, int]]) -> None:
        """A chain of chunks, first chunk first, and its blocks: (block hash, the index of
        the first chunk that needs it)."""
        for k in range(1, len(chunks)):
            self._prev[chunks[k]] = chunks[k - 1]
            self._next.setdefault(chunks[k - 1], set()).add(chunks[k])
        for block, k in owned:
            chunk = chunks[k]
            self._needing.setdefault(block, set()).add(chunk)
            self._needs.setdefault(chunk, set()).add(block)

    def needing(self, block: bytes) -> list[str]:
        """The chunks that need ``block`` first."""
        return list(self._needing.get(block, ()))

    def with_later(self, chunk: str) -> list[str]:
        """``chunk`` and every chunk that continues it, at any depth."""
        out, todo = [], [chunk]
        while todo:
            c = todo.pop()
            out.append(c)
            todo.extend(self._next.get(c, ()))
        return out

    def forget(self, chunk: str) -> None:
        """Drop every link of ``chunk`` (the chunks continuing it stay, unlinked)."""
        prev = self._prev.pop(chunk, None)
        if prev is not None:
            siblings = self._next.get(prev)
            if siblings is not None:
                siblings.discard(chunk)
                if not siblings:
                    del self._next[prev]
        for child in self._next.pop(chunk, ()):
            self._prev.pop(child, None)
        for block in self._needs.pop(chunk, ()):
            needing = self._needing.get(block)
            if needing is not None:
                needing.discard(chunk)
                if not needing:
                    del self._needing[block]

    def __len__(self) -> int:
        """Block hashes mapped (their count is bounded by the chunks held)."""
        return len(self._needing)
