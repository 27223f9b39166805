"""Speculative decoding of rows with a grammar: exactly speculation off.

Drafts of a constrained row are cut at the first token its grammar rejects, and each of
the row's 1 + k positions samples under the mask of the state after the drafts before it.
On the shipped default model: JSON-schema requests, greedy and seeded, over a prompt that
repeats a record (drafts from the row's own context) and a second pass of the same
requests (drafts from the store) give token-for-token what speculation off gives, every
output validates against its schema (``jsonschema``, not the grammar engine), and the
counters show drafts proposed and accepted. A store seeded with a continuation the schema
forbids makes drafts that are cut before the forbidden token; outputs stay identical.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from protocol.sampling import SamplingParams
from protocol.structured.constraint import StructuredOutput
from protocol.tenants.ids import DEFAULT_TENANT
from tests.worker.engine.structured.test_structured import SCHEMA
from worker.engine.request import Request
from worker.engine.structured.decoding import StructuredOutputs

RECORD = '{"name":"Ann","age":31,"color":"red","tags":["a","b"]}'
REPEATED = f"# person records, as JSON\nrecord = {RECORD}\nrecord = {RECORD}\nrecord = "
PLAIN = "# a person record, as JSON\nrecord = "
SPEC = StructuredOutput(json_schema=SCHEMA)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=80, structured_output=SPEC)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_output=SPEC)
              for s in range(4)]
    return [greedy, *seeded]


@pytest.fixture(scope="module")
def engines() -> tuple[Any, Any]:
    from worker import LLM

    torch.set_num_threads(2)
    opts: dict[str, Any] = dict(device="cpu", kv_cache_blocks=512, max_num_seqs=8)
    on = LLM(**opts, speculative="suffix", num_speculative_tokens=8, min_match_tokens=1)
    return on, LLM(**opts)


def _same_and_valid(on: Any, off: Any, prompts: list[str], params: list[SamplingParams]
                    ) -> None:
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, (g.text, w.text)
        assert g.finish_reason == w.finish_reason == "stop", (g.finish_reason, g.text)
        jsonschema.validate(json.loads(g.text), SCHEMA)


def test_json_schema_rows_draft_and_match_speculation_off(engines: tuple[Any, Any]) -> None:
    on, off = engines
    params = _params()
    before = on.engine.stats()
    for _ in range(2):  # the second pass drafts from the store too
        _same_and_valid(on, off, [REPEATED] * len(params), params)
    stats = on.engine.stats()
    assert stats.spec_draft_rows > before.spec_draft_rows
    assert stats.spec_accepted_tokens - before.spec_accepted_tokens > \
        stats.spec_draft_rows - before.spec_draft_rows  # over one accepted per drafted row


def test_draft_cut_at_a_token_the_grammar_rejects(engines: tuple[Any, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The store holds each request's true output up to a point, then a token the schema
    forbids there: the drafts up to it are verified, it never is."""
    on, off = engines
    params = _params()
    want = off.generate([PLAIN] * len(params), params)
    pristine = on.engine.structured.compiler.compile(SPEC).result()
    prompt_ids = on.tokenizer(PLAIN)["input_ids"]
    candidates = [on.tokenizer(t, add_special_tokens=False)["input_ids"][0]
                  for t in ("\n", "}}", "@", "zz")]
    bad: dict[int, int] = {}  # the forbidden token each request's store text ends with
    for i, out in enumerate(want):
        cut = len(out.token_ids) * 2 // 3
        bad[i] = next(t for t in candidates  # one the schema forbids after the cut
                      if pristine.deep_copy().validate_tokens(out.token_ids[:cut] + [t]) == cut)
        on.engine.spec.proposer.store.add(prompt_ids + out.token_ids[:cut] + [bad[i]],
                                          DEFAULT_TENANT)
    seen: list[tuple[list[int], int]] = []
    valid_draft = on.engine.structured.valid_draft

    def spy(request: Request, draft: list[int]) -> int:
        seen.append((list(draft), valid := valid_draft(request, draft)))
        return valid

    monkeypatch.setattr(on.engine.structured, "valid_draft", spy)
    cuts = on.engine.stats().spec_grammar_cut_tokens
    _same_and_valid(on, off, [PLAIN] * len(params), params)
    assert on.engine.stats().spec_grammar_cut_tokens > cuts
    assert any(0 < valid < len(d) and d[valid] in bad.values() for d, valid in seen)


def test_masks_per_draft_position(engines: tuple[Any, Any]) -> None:
    """The bitmask of a drafted constrained row: position j has the mask after its first
    j drafts (the bonus position after all), laid out after every sampling row; the
    matcher ends where it began. Oracle: fresh matchers fed each prefix."""
    on, _ = engines
    structured: StructuredOutputs = on.engine.structured
    tok = on.tokenizer
    a, free, b = (Request(rid, [1, 2], SamplingParams(structured_output=spec))
                  for rid, spec in (("a", SPEC), ("free", None), ("b", SPEC)))
    for request in (a, b):
        structured.attach(request)
        request.grammar.future.result()
        assert not structured.poll() and request.grammar.ready
    b.output_token_ids = tok('{"name":"Bo","age":', add_special_tokens=False)["input_ids"]
    drafts = {"a": tok('{"name":"Ann"', add_special_tokens=False)["input_ids"],
              "free": [5, 6, 7], "b": tok('4,"color"', add_special_tokens=False)["input_ids"]}
    requests = [a, free, b]
    got = structured.start_bitmask(requests, drafts).get()
    assert got is not None
    rows, bitmask = got
    ka, kb = len(drafts["a"]), len(drafts["b"])
    first_b = 3 + ka + 3  # after the three sampling rows, a's drafts and free's
    assert rows == [*range(3, 3 + ka), 0, *range(first_b, first_b + kb), 2]
    pristine = structured.compiler.compile(SPEC).result()
    words = (structured.vocab_size + 31) // 32
    expect = [_mask(pristine, drafts["a"][:j], words) for j in range(ka + 1)]
    expect += [_mask(pristine, b.output_token_ids + drafts["b"][:j], words)
               for j in range(kb + 1)]
    assert torch.equal(bitmask, torch.stack(expect))
    again = structured.start_bitmask(requests).get()  # the matchers are back where they were
    assert again is not None and again[0] == [0, 2]
    assert torch.equal(again[1], torch.stack([expect[0], expect[ka + 1]]))


def _mask(pristine: Any, tokens: list[int], words: int) -> torch.Tensor:
    matcher = pristine.deep_copy()
    assert matcher.consume_tokens(tokens)
    mask = torch.zeros(words, dtype=torch.int32)  # [W]
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
    return mask
