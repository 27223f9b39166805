"""Logprobs in OpenAI's and vLLM's layouts, from the wire's token and prompt logprobs.

* completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
  ({token: logprob}), ``text_offset``. Offsets count characters from the start of the
  choice's text, streamed or not: a ``CompletionLogprobs`` keeps the running offset of
  one choice across chunks. With ``echo`` the prompt's tokens come first, the first one
  with null logprob and null top (as OpenAI answers).
* chat: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``.
* vLLM's ``prompt_logprobs``: ``[null, {token_id: {logprob, rank, decoded_token}}, ...]``,
  each entry holding the prompt token and its top alternatives.

``as_ids`` is vLLM's ``return_tokens_as_token_ids``: tokens spelled ``token_id:N``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from protocol.models import PromptLogprob, TokenEvent, TokenLogprob, TopLogprob

AnyLogprob = TokenLogprob | PromptLogprob | TopLogprob
Entry = TokenLogprob | PromptLogprob  # one with alternatives


def token_text(lp: AnyLogprob, as_ids: bool = False) -> str:
    if as_ids or lp.token is None:
        return f"token_id:{lp.token_id}"
    return lp.token


def entries_of(events: Iterable[TokenEvent]) -> list[TokenLogprob]:
    return [lp for e in events for lp in (e.logprobs or [])]


class CompletionLogprobs:
    """The legacy completions layout for one choice; ``offset`` runs across chunks."""

    def __init__(self, as_ids: bool = False, offset: int = 0) -> None:
        self.as_ids = as_ids
        self.offset = offset

    def block(self, entries: Sequence[Entry]) -> dict[str, Any]:
        """The lists for ``entries``, continuing the offset from the previous block."""
        tokens = [token_text(lp, self.as_ids) for lp in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [
                None if isinstance(lp, PromptLogprob) and lp.logprob is None
                else {token_text(t, self.as_ids): t.logprob for t in lp.top}
                for lp in entries],
            "text_offset": offsets,
        }


def merge(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy blocks as one (echo: the prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def chat_content(entries: Sequence[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """Chat layout: one entry per token with its bytes and its top alternatives."""

    def entry(lp: AnyLogprob) -> dict[str, Any]:
        text = token_text(lp, as_ids)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top]}
                        for lp in entries]}


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob],
                         as_ids: bool = False) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, its own and its top alternatives'."""
    out: list[dict[str, Any] | None] = []
    for lp in entries:
        if lp.logprob is None:
            out.append(None)
            continue
        ranked = {t.token_id: rank for rank, t in enumerate(lp.top, 1)}
        item = {str(lp.token_id): {"logprob": lp.logprob, "rank": ranked.get(lp.token_id),
                                   "decoded_token": token_text(lp, as_ids)}}
        for rank, t in enumerate(lp.top, 1):
            item.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                              "decoded_token": token_text(t, as_ids)})
        out.append(item)
    return out
