"""n > 1 and best_of: a request's candidates as independent engine requests.

A request asking for ``n`` choices (or ``best_of`` candidates, of which the best ``n`` are
kept) becomes that many engine requests over the same prompt token ids. They share the
prompt's KV blocks through the prefix cache — admitted in one step, the first registers
the prompt's full blocks and the others hit them — so the prompt is prefilled once.

Each candidate ``i`` samples with its own seed derived from the request's seed and ``i``
(candidate 0 keeps the request's seed, so ``n=1`` is unchanged), which keeps seeded
requests reproducible and batch-independent. Candidate ids are ``{request_id}#{i}``:
``#`` cannot appear in a request id, so they never collide with one. Outputs carry the
parent's id and the candidate's ``index``; ranking ``best_of`` candidates by cumulative
logprob is the consumer's job (it sees every candidate's finish).
"""

from __future__ import annotations

from protocol.sampling import SamplingParams

_SEED_STEP = 0x9E3779B97F4A7C15
_SEED_MOD = 2**63


def derive_seed(seed: int | None, index: int) -> int | None:
    """Candidate ``index``'s seed: the request's own for index 0, a mix of both otherwise."""
    if seed is None or index == 0:
        return seed
    return (seed * _SEED_STEP + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % _SEED_MOD


def candidate_id(request_id: str, index: int, count: int) -> str:
    """The engine id of one candidate (the request's own id when there is only one)."""
    return request_id if count == 1 else f"{request_id}#{index}"


def candidate_params(params: SamplingParams, index: int) -> SamplingParams:
    """One candidate's parameters: a single sequence, its own seed, the chosen token's
    logprob computed when candidates are ranked (reported only if the request asked), and
    prompt logprobs (if asked) computed by candidate 0 alone."""
    update: dict[str, object] = {"n": 1, "best_of": None, "seed": derive_seed(params.seed, index)}
    if index > 0:  # the prompt is the same for every candidate: the first reports it
        update["prompt_logprobs"] = None
    if params.ranks_candidates and params.logprobs is None:
        update["logprobs"] = 0
    return params.model_copy(update=update)


class CandidateGroups:
    """Which candidates of each multi-choice request are still unfinished, so an abort of
    the request reaches every one of them."""

    def __init__(self) -> None:
        self._open: dict[str, list[str]] = {}  # request id -> its unfinished candidate ids

    def add(self, request_id: str, candidate: str) -> None:
        self._open.setdefault(request_id, []).append(candidate)

    def take(self, request_id: str) -> list[str]:
        """The ids to abort for ``request_id``: its open candidates, or the id itself."""
        return self._open.pop(request_id, None) or [request_id]

    def finished(self, request_id: str, candidate: str) -> None:
        group = self._open.get(request_id)
        if group is not None and candidate in group:
            group.remove(candidate)
            if not group:
                del self._open[request_id]
