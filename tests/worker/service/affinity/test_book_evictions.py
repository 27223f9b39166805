"""The affinity book follows the prefix cache's evictions: each chunk is booked with the
prompt blocks it needs (characters to tokens in proportion, rounded down), and a block
gone drops the chunks that need it and every later chunk of their chains, nothing
earlier, nothing of another chain that does not continue them, and nothing of another
tenant's identical prompt (chunks and blocks are both rooted in the cache partition).
"""

from __future__ import annotations

import pytest

from protocol.models import GenerateRequest, SamplingParams
from protocol.tenants.cache_scope import cache_partition
from worker.engine.kv.block_manager import BlockManager
from worker.engine.request import Request
from worker.service.affinity.book import AffinityBook
from worker.service.affinity.chains import Prefix, block_owners, prefix_of

BS = 16
SHARED = "A system prompt every conversation of this tenant starts with. " * 9  # 2 chunks


def _convo(name: str, tenant: str | None = None) -> GenerateRequest:
    return GenerateRequest(prompt=SHARED + f"Conversation {name}: " + name * 1500,
                           tenant=tenant, request_id=f"{tenant}::{name}" if tenant else name)


def _tokens(request: GenerateRequest) -> list[int]:
    """Stand-in token ids, one a character (what block keys hash is immaterial here)."""
    assert request.prompt is not None
    return [ord(c) % 251 for c in request.prompt]


def _book(book: AffinityBook, request: GenerateRequest) -> tuple[list[str], list[bytes]]:
    """Book ``request`` as the engine loop does at admission; returns its chunks and its
    prompt's block hashes (the engine's own keys, rooted in its cache partition)."""
    prefix = prefix_of(request)
    assert prefix is not None
    tokens = _tokens(request)
    owners = block_owners(prefix, len(tokens), BS)
    scope = cache_partition(request.tenant, request.cache_scope, request.cache_salt)
    engine_request = Request("r", tokens, SamplingParams(max_tokens=1), cache_scope=scope)
    hashes = BlockManager(64, BS).block_hashes(engine_request, len(owners))
    book.served(prefix, zip(hashes, owners, strict=True))
    return prefix.chunks, hashes


def test_block_owners_map_characters_to_tokens_rounding_down() -> None:
    three = Prefix(["c0", "c1", "c2"], text_chars=800, weight=1.0)
    # chunk ends at 256, 512, 768 characters = 64, 128, 192 of 200 tokens: blocks 3, 7, 11
    assert block_owners(three, 200, BS) == [0] * 4 + [1] * 4 + [2] * 4
    # 256 of 1,000 characters is 25.6 tokens of 100: rounded down to 25, in block 1
    assert block_owners(Prefix(["c0"], 1000, 1.0), 100, BS) == [0, 0]
    # the last chunk ends in the prompt's partly filled last block: the full one before
    assert block_owners(Prefix(["c0", "c1"], 520, 1.0), 100, BS)[-1] == 1
    assert len(block_owners(Prefix(["c0", "c1"], 520, 1.0), 100, BS)) == 6
    assert block_owners(Prefix(["c0"], 300, 1.0), 15, BS) == []  # no full block
    with pytest.raises(ValueError, match="block_owners"):
        block_owners(three, 0, BS)


def test_an_evicted_block_drops_its_chunk_and_the_later_ones_of_its_chain() -> None:
    book = AffinityBook(capacity_tokens=1_000_000)
    a_chunks, a_blocks = _book(book, _convo("a"))
    b_chunks, b_blocks = _book(book, _convo("b"))
    assert a_chunks[:2] == b_chunks[:2] and a_chunks[2] != b_chunks[2]  # shared prompt
    book.take()
    # a block in the middle of a's own chunks: that chunk of a and every later one go
    prefix = prefix_of(_convo("a"))
    assert prefix is not None and len(a_chunks) == 8
    owners = block_owners(prefix, len(_tokens(_convo("a"))), BS)
    k = 4
    middle = owners.index(k) + 1  # a block chunk k needs, not the one it ends in
    assert owners[middle] == k
    assert book.evicted([a_blocks[middle]]) == len(a_chunks) - k
    changes = book.take()
    assert changes.removed == set(a_chunks[k:]) and not changes.added
    assert len(book) == len(set(a_chunks[:k]) | set(b_chunks))
    assert book.evicted([a_blocks[middle]]) == 0  # already dropped: nothing more
    # a block of the shared system prompt: both conversations from there on
    first = owners.index(1)
    assert book.evicted([b_blocks[first]]) == len(set(a_chunks[1:k]) | set(b_chunks[1:]))
    assert len(book) == 1 and book.take().removed == set(a_chunks[1:k]) | set(b_chunks[1:])
    assert book.evicted([b"not a block this book knows"]) == 0


def test_another_tenants_identical_prompt_is_untouched() -> None:
    book = AffinityBook(capacity_tokens=1_000_000)
    mine, my_blocks = _book(book, _convo("a", tenant="acme"))
    theirs, their_blocks = _book(book, _convo("a", tenant="globex"))
    assert not set(mine) & set(theirs) and not set(my_blocks) & set(their_blocks)
    book.take()
    assert book.evicted(my_blocks[:1]) == len(mine)  # the first block: the whole chain
    assert book.take().removed == set(mine)
    assert len(book) == len(theirs)
    full = book.take(full=True)
    assert set(full.added) == set(theirs)


def test_a_chunk_served_again_after_its_eviction_is_watched_again() -> None:
    book = AffinityBook(capacity_tokens=1_000_000)
    chunks, blocks = _book(book, _convo("a"))
    book.evicted(blocks[-1:])
    assert chunks[-1] not in book.take(full=True).added
    _book(book, _convo("a"))  # computed again
    assert set(book.take().added) == set(chunks)
    assert book.evicted(blocks[-1:]) >= 1 and chunks[-1] in book.take().removed


def test_the_block_map_holds_only_what_the_book_holds() -> None:
    """The backstop (least recently served, by weight) forgets the blocks of the chunks
    it drops, so the map stays bounded by the book."""
    prefix = prefix_of(_convo("a"))
    assert prefix is not None
    book = AffinityBook(capacity_tokens=int(prefix.weight * len(prefix.chunks) * 1.5))
    a_chunks, a_blocks = _book(book, _convo("a"))
    mapped = len(book._chains)
    assert mapped == len(a_blocks)
    b_chunks, b_blocks = _book(book, _convo("b"))  # outweighs the bound: a's own chunks go
    assert book.take(full=True).added.keys() == set(b_chunks)
    assert len(book._chains) == len(b_blocks) == mapped
    assert book.evicted(a_blocks[-1:]) == 0  # a's own blocks: forgotten with its chunks
