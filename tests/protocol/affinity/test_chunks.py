"""Chunk hashes: a next turn extends the previous turn's chain, and a chain never crosses
a cache partition (tenant, sharing group, salt) or a model."""

from __future__ import annotations

from protocol.affinity.chunks import CHUNK_CHARS, MAX_CHUNKS, prefix_chunks
from protocol.models import ChatMessage, GenerateRequest

SYSTEM = "You are a careful assistant. " * 40  # ~1,160 characters


def _chat(*turns: str, **kw: object) -> GenerateRequest:
    messages = [ChatMessage(role="system", content=SYSTEM)]
    for i, text in enumerate(turns):
        messages.append(ChatMessage(role="user" if i % 2 == 0 else "assistant", content=text))
    return GenerateRequest(messages=messages, **kw)  # type: ignore[arg-type]


def test_a_next_turn_extends_the_previous_turns_chain() -> None:
    first = prefix_chunks(_chat("What is a queue? " * 20))
    second = prefix_chunks(_chat("What is a queue? " * 20, "A line. " * 40, "And a stack?"))
    assert len(first) >= 5 and second[:len(first) - 1] == first[:-1]
    assert len(second) > len(first)


def test_chunks_differ_once_the_text_does_and_short_inputs_have_none() -> None:
    a = prefix_chunks(GenerateRequest(prompt="a" * (3 * CHUNK_CHARS)))
    b = prefix_chunks(GenerateRequest(prompt="a" * (2 * CHUNK_CHARS) + "b" * CHUNK_CHARS))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_chunks(GenerateRequest(prompt="short")) == []
    assert len(prefix_chunks(GenerateRequest(prompt="x" * CHUNK_CHARS * (MAX_CHUNKS + 9)))) \
        == MAX_CHUNKS
    # a prompt as text and the same characters as chat content are different inputs
    assert prefix_chunks(GenerateRequest(prompt=SYSTEM * 2))[0] != prefix_chunks(_chat())[0]


def test_no_chunk_is_shared_across_partitions_or_models() -> None:
    turn = ("Hello " * 60,)
    chains = [prefix_chunks(_chat(*turn, **kw)) for kw in (
        {}, {"tenant": "acme", "request_id": "acme::1"},
        {"tenant": "beta", "request_id": "beta::1"},
        {"tenant": "acme", "request_id": "acme::2", "cache_salt": "user-1"},
        {"tenant": "acme", "request_id": "acme::3", "cache_scope": "public"},
        {"tenant": "beta", "request_id": "beta::3", "cache_scope": "public"},
        {"model": "adapter-a"},
    )]
    firsts = [c[0] for c in chains]
    # two tenants of one sharing group share; every other pair does not
    assert firsts[4] == firsts[5]
    assert len(set(firsts)) == len(firsts) - 1
    # and a tenant's own requests share with each other
    again = prefix_chunks(_chat(*turn, tenant="acme", request_id="acme::9"))
    assert again == chains[1]
