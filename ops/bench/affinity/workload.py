"""The affinity benchmark's workload: conversations over a long system prompt of random
words, each turn's messages holding the previous answers, sent through the Redis client
library and timed to their first token."""

from __future__ import annotations

import random
import time

from protocol.client import FerryClient
from protocol.models import ChatMessage, GenerateRequest, JobStatus, SamplingParams, TokenEvent
from protocol.streaming import status_from_events

WORDS = ["queue", "lease", "worker", "stream", "tenant", "prefix", "cache", "block", "token",
         "batch", "prefill", "decode", "replica", "shard", "heartbeat", "cancel", "deadline",
         "priority", "lane", "backlog", "fair", "share"]


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are the operations assistant. Context: " + " ".join(
        rng.choice(WORDS) for _ in range(words)) + "."


def conversation(tag: str, system: str, turns: int, answers: list[str], seed: int,
                 answer_tokens: int) -> GenerateRequest:
    msgs = [ChatMessage(role="system", content=system)]
    for t in range(turns):
        msgs.append(ChatMessage(role="user", content=f"({tag}) Question {t}: what happens "
                                f"to the request when step {t} fails?"))
        if t < turns - 1:
            msgs.append(ChatMessage(role="assistant", content=answers[t]))
    return GenerateRequest(messages=msgs, request_id=f"{tag}-t{turns}-{time.time_ns()}",
                           params=SamplingParams(max_tokens=answer_tokens, temperature=0.8,
                                                 seed=seed + turns, ignore_eos=True))


def send(client: FerryClient, req: GenerateRequest) -> tuple[JobStatus, float | None]:
    """Send one request and follow its stream: its result, and the seconds from the send
    (the producer's affinity look-up and push included) to its first token's event."""
    events: list[TokenEvent] = []
    first = None
    with client.subscribe(req.request_id) as sub:
        sent = time.monotonic()
        client.enqueue(req)
        for event in sub.events(900):
            if first is None and event.token_ids:
                first = time.monotonic() - sent
            events.append(event)
    return status_from_events(req, events), first
