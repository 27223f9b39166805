"""The draft store is per tenant: no tenant drafts from another's outputs or prompts.

On the shipped default model, CPU, speculation on: tenant A's repeat of its own request
drafts from A's stored output (drafts accepted), tenant B's identical request drafts
nothing from the store, and both get the tokens they get with speculation off. The
attack of the store as an oracle: after A's prompt carried a secret, B forces each of
several candidate texts with a regex (structured output, as ``guided_regex`` does) and
counts the drafts it gets; the secret gets no more than any other candidate.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from protocol.structured.constraint import StructuredOutput
from protocol.tenants.ids import scoped_id
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.models import default_model_path

PROMPT = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the "
          "directories given on the command line.\"\"\"\n    for top in argv[1:]:\n")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SECRET = "Vq7Zx3Kp9Lm"
CANDIDATES = ["Hd4Wy8Nb2Rt", SECRET, "Jc6Fs1Tg5Qe", "Bn3Xk7Mv4Pz"]
SECRET_PROMPT = f"# settings.py\nDEBUG = False\nDB_PASSWORD = '{SECRET}'\nDB_HOST = 'db'\n"
PROBE_PROMPT = "# settings.py\nDEBUG = False\nDB_PASSWORD = '"


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    torch.set_num_threads(2)
    opts: dict[str, Any] = dict(device="cpu", num_blocks=256, max_num_seqs=4)
    # the back-off all but off: every match drafts, so a store hit cannot hide
    on = Engine(EngineConfig.create(default_model_path(), **opts, speculative="suffix",
                                    draft_token_cost=1e-3, draft_step_cost=0.0))
    return on, Engine(EngineConfig.create(default_model_path(), **opts))


def _serve(engine: Engine, tenant: str, rid: str, prompt: str, params: SamplingParams
           ) -> tuple[list[int], dict[str, int]]:
    """One request alone: its tokens and the speculative counters it moved."""
    before = engine.stats()
    request_id = scoped_id(tenant, rid)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    text = TextOutputs.of(engine)
    while engine.has_unfinished_requests():
        for out in text.step():
            assert out.request_id == request_id and out.error is None, out.error
            tokens += out.new_token_ids
    after = engine.stats()
    moved = {name: getattr(after, f"spec_{name}") - getattr(before, f"spec_{name}")
             for name in ("drafted_tokens", "accepted_tokens", "draft_rows", "store_rows")}
    return tokens, moved


def test_a_tenant_drafts_from_its_own_outputs_only(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    want, _ = _serve(off, "alice", "plain", PROMPT, GREEDY)
    first, _ = _serve(on, "alice", "first", PROMPT, GREEDY)
    again, mine = _serve(on, "alice", "again", PROMPT, GREEDY)
    other, theirs = _serve(on, "bob", "same", PROMPT, GREEDY)
    assert first == again == other == want  # verified drafts change no token
    assert mine["store_rows"] > 0 and mine["accepted_tokens"] > 0, mine
    assert theirs["store_rows"] == 0, theirs  # alice's output is never offered to bob
    assert on.spec is not None
    assert on.spec.store.tokens_of("alice") > 0 and on.spec.store.tokens_of("bob") > 0


def test_forcing_candidates_tells_nothing_about_another_tenants_secret(
        engines: tuple[Engine, Engine]) -> None:
    """Bob forces each candidate after alice's prompt held the secret: the drafts bob gets
    are the same for the secret as for the others."""
    on, off = engines
    _serve(on, "alice", "secret", SECRET_PROMPT, GREEDY)
    moved: dict[str, dict[str, int]] = {}
    for i, candidate in enumerate(CANDIDATES):
        params = SamplingParams(temperature=0.0, max_tokens=24, structured_output=(
            StructuredOutput(regex=re.escape(candidate) + "'")))
        got, moved[candidate] = _serve(on, "bob", f"probe-{i}", PROBE_PROMPT, params)
        want, _ = _serve(off, "bob", f"probe-{i}", PROBE_PROMPT, params)
        assert got == want
        assert on.tokenizer.decode(got) == candidate + "'"
    assert all(m["store_rows"] == 0 for m in moved.values()), moved
    assert len({(m["drafted_tokens"], m["accepted_tokens"], m["draft_rows"])
                for m in moved.values()}) == 1, moved
    # alice, forcing her own secret, is drafted from her own prompt
    _, hers = _serve(on, "alice", "own", PROBE_PROMPT, SamplingParams(
        temperature=0.0, max_tokens=24,
        structured_output=StructuredOutput(regex=re.escape(SECRET) + "'")))
    assert hers["store_rows"] > 0 and hers["accepted_tokens"] > 0, hers
