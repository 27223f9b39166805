"""The adaptive back-off: confident drafts survive a big batch, weak ones do not,
and what is learnt moves the estimate; outputs stay exact (test_spec_decode.py)."""

from __future__ import annotations

from worker.engine.speculative.backoff import (
    MAX_TENANTS,
    AcceptanceModel,
    bucket,
    draft_cost,
    prior,
)
from worker.engine.speculative.config import SpeculativeConfig

COSTS = SpeculativeConfig("suffix").costs


def test_certain_drafts_survive_batch_16_and_weak_ones_do_not() -> None:
    assert draft_cost(1.0, 16, 16, COSTS) == 16  # a retry: every token accepted
    assert draft_cost(1.0, 16, 64, COSTS) == 16
    assert draft_cost(0.3, 16, 16, COSTS) == 0  # a weak match in a batch: nothing
    assert draft_cost(0.4, 16, 64, COSTS) == 0
    assert 0 < draft_cost(0.6, 16, 1, COSTS) < 16  # at batch 1 a short draft pays
    assert draft_cost(0.03, 16, 1, COSTS) == 0  # a hopeless one drafts nothing even at 1
    assert draft_cost(1.0, 3, 1, COSTS) == 3  # never past the proposer's limit
    assert draft_cost(1.0, 0, 1, COSTS) == 0


def test_draft_shrinks_as_batch_grows_and_acceptance_falls() -> None:
    by_batch = [draft_cost(0.85, 16, b, COSTS) for b in (1, 4, 16, 64, 256)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1]
    by_p = [draft_cost(p, 16, 8, COSTS) for p in (0.5, 0.7, 0.9, 0.99)]
    assert by_p == sorted(by_p) and by_p[0] < by_p[-1]


def test_step_cost_alone_can_stop_a_draft() -> None:
    # one draft token at p = 0.5 pays for itself but not for the step's switch at batch 1
    assert draft_cost(0.5, 1, 1, (13.0, 0.55, 0.0)) == 1
    assert draft_cost(0.5, 1, 1, (13.0, 0.55, 20.0)) == 0


def test_estimates_learn_from_verification() -> None:
    model = AcceptanceModel(COSTS)
    assert model.estimate("a", "t", "store", 32) == prior(32)
    before = model.draft_length("a", "t", "store", 32, 16, 16)
    for _ in range(10):  # the store's long matches keep failing at the first token
        model.record("a", "t", "store", 32, 16, 0)
    assert model.estimate("a", "t", "store", 32) < 0.2
    assert model.draft_length("a", "t", "store", 32, 16, 16) == 0 < before
    # a fresh request starts from the bucket's record, another bucket is untouched
    assert model.estimate("b", "t", "store", 32) < 0.3
    assert model.draft_length("b", "t", "store", 32, 16, 16) == 0
    assert model.estimate("b", "t", "store", 4) == prior(4)
    assert bucket(4) != bucket(32)
    for _ in range(50):  # it recovers when the drafts are accepted again
        model.record("c", "t", "store", 32, 16, 16)
    assert model.estimate("c", "t", "store", 32) > 0.9
    model.forget("c")
    assert model.estimate("c", "t", "store", 32) > 0.7


def test_one_tenants_drafts_never_move_anothers_estimates() -> None:
    """Tenant a's rejected store drafts leave tenant b's rows drafting as before: no tenant
    can slow another's speculation, or read another's acceptance from its own timing."""
    model = AcceptanceModel(COSTS)
    before = model.draft_length("b1", "b", "store", 32, 16, 16)
    for _ in range(20):
        model.record("a1", "a", "store", 32, 16, 0)
    assert model.draft_length("a2", "a", "store", 32, 16, 16) == 0 < before
    assert model.estimate("b1", "b", "store", 32) == prior(32)
    assert model.draft_length("b1", "b", "store", 32, 16, 16) == before


def test_estimates_of_at_most_max_tenants_are_kept() -> None:
    model = AcceptanceModel(COSTS)
    for i in range(MAX_TENANTS + 10):
        model.record(f"r{i}", f"t{i}", "own", 8, 4, 4)
    assert len(model._tenants) == MAX_TENANTS
    assert model.estimate("x", "t0", "own", 8) == prior(8)  # gone: back to the prior
    assert model.estimate("x", f"t{MAX_TENANTS + 9}", "own", 8) > prior(8)
