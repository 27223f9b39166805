"""Parallel tool calls end where ``max_tokens`` cannot hold another call
(``worker/engine/structured/call_budget.py``), on the shipped default model.

Every output is read back by the gateway's parser and its call ends found by decoding its
own tokens, never by the grammar engine: an output cut by ``max_tokens`` must have had, at
its last complete call, at least as many tokens left as its shortest call took (else the
list should have ended there). With the budget turned off the same requests end in cut
calls far more often; with speculation on the tokens are the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from protocol.structured.constraint import StructuredOutput
from protocol.structured.tool_syntax import parse_calls, whole_arguments
from protocol.structured.tools import FunctionTool, ToolCalls
from worker.engine.structured import call_budget

TOOLS = [
    FunctionTool(name="add", parameters={"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}),
    FunctionTool(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}),
]
SPEC = StructuredOutput(tools=ToolCalls(tools=TOOLS, mode="required"))
PROMPT = "# calls\n"
CASES = [(budget, seed) for budget in (50, 80, 120) for seed in range(6)]


def _params(budget: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=budget,
                          structured_output=SPEC)


@pytest.fixture(scope="module")
def llm() -> Any:
    from worker import LLM

    torch.set_num_threads(2)
    return LLM(device="cpu", kv_cache_blocks=512, max_num_seqs=32)


def _run(llm: Any) -> list[Any]:
    return llm.generate([PROMPT] * len(CASES), [_params(b, s) for b, s in CASES])


def _ends(llm: Any, ids: list[int]) -> list[int]:
    """Output lengths at which a call closed."""
    return [i for i in range(1, len(ids) + 1)
            if llm.tokenizer.decode(ids[:i]).endswith("</tool_call>")
            and not llm.tokenizer.decode(ids[:i - 1]).endswith("</tool_call>")]


def _cut(out: Any) -> bool:
    parsed = parse_calls(out.text, {t.name for t in TOOLS}, cut=True)
    return out.finish_reason == "length" and parsed is not None and bool(parsed[1]) \
        and not whole_arguments(parsed[1][-1][1])


def test_a_list_of_calls_ends_before_a_call_that_cannot_fit(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    outs = _run(llm)
    for (budget, _), out in zip(CASES, outs, strict=True):
        ends = _ends(llm, out.token_ids)
        if out.finish_reason == "stop":  # ended by the grammar or the budget: whole calls
            assert parse_calls(out.text, {t.name for t in TOOLS}) is not None, out.text
            continue
        shortest = min((e - s for s, e in zip([0, *ends], ends, strict=False)),
                       default=None)
        if ends and shortest is not None:  # the last end had room for another call
            assert budget - ends[-1] >= shortest, (budget, ends, out.text)
    monkeypatch.setattr(call_budget.CallBudget, "of", staticmethod(lambda *a: None))
    unbounded = _run(llm)
    with_rule, without = sum(map(_cut, outs)), sum(map(_cut, unbounded))
    assert with_rule < without, (with_rule, without)
    for out, free in zip(outs, unbounded, strict=True):  # the same tokens up to its end
        assert free.token_ids[:len(out.token_ids) - 1] == out.token_ids[:-1] \
            or out.token_ids == free.token_ids


def test_speculation_gives_the_same_tokens(llm: Any) -> None:
    from worker import LLM

    spec = LLM(device="cpu", kv_cache_blocks=512, max_num_seqs=32, speculative="suffix",
               num_speculative_tokens=8, min_match_tokens=1)
    assert [o.token_ids for o in _run(spec)] == [o.token_ids for o in _run(llm)]
