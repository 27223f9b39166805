"""Structured output through the real engine on the shipped default model.

Every constrained output is checked by an independent oracle (``json.loads`` + the
``jsonschema`` package, ``re.fullmatch``, membership in the choice list), never by the
grammar engine itself. Mixed batches are compared with the same requests run alone:
seeded sampling must not depend on which rows around it are constrained.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import jsonschema
import pytest
import torch

from protocol.sampling import SamplingParams
from worker.engine.output.outputs import TextOutput
from worker.engine.output.text_output import TextOutputs
from worker.engine.sample.logits_processors import (
    _apply_bitmask_numpy,
    _apply_bitmask_torch,
    apply_token_bitmask,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPT = "# a person record, as JSON\nrecord = "
CHOICES = ["True", "False", "None"]
REGEX = r"[a-z]{2,6}_[0-9]{1,3}"


def _json(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                          structured_output={"json_schema": SCHEMA}, **kw)


@pytest.fixture(scope="module")
def llm() -> Any:
    from worker import LLM

    torch.set_num_threads(2)
    return LLM(device="cpu", kv_cache_blocks=512, max_num_seqs=64)


def _solo(llm: Any, prompt: str, params: SamplingParams) -> Any:
    return llm.generate([prompt], params)[0]


def test_fifty_seeded_json_schema_requests_validate(llm: Any) -> None:
    compiles = llm.engine.structured.compiler.compiles
    outs = llm.generate([PROMPT] * 50, [_json(seed) for seed in range(50)])
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 10  # seeded sampling, not one forced answer
    assert llm.engine.structured.compiler.compiles == compiles + 1  # one compile, 50 uses


def test_choice_and_regex_always_hold(llm: Any) -> None:
    choice = [SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                             structured_output={"choice": CHOICES}) for s in range(12)]
    regex = [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                            structured_output={"regex": REGEX}) for s in range(12)]
    outs = llm.generate(["x = "] * 24, choice + regex)
    for out in outs[:12]:
        assert out.text in CHOICES and out.finish_reason == "stop"
    for out in outs[12:]:
        assert re.fullmatch(REGEX, out.text), out.text
        assert out.finish_reason == "stop"


def test_ebnf_grammar_and_json_object(llm: Any) -> None:
    grammar = 'root ::= "import " name ("." name)?\nname ::= [a-z]{1,8}'
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24,
                             structured_output={"grammar": grammar}) for s in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=64,
                              structured_output={"json_object": True})]
    outs = llm.generate(["\n"] * 7, params)
    for out in outs[:6]:
        assert re.fullmatch(r"import [a-z]{1,8}(\.[a-z]{1,8})?", out.text), out.text
    if outs[6].finish_reason == "stop":
        assert isinstance(json.loads(outs[6].text), dict)
    else:
        assert outs[6].text.startswith("{")


def test_mixed_batch_matches_solo_runs(llm: Any) -> None:
    """Free and constrained seeded rows in one batch give what each gives alone."""
    free = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=24) for i in range(4)]
    constrained = [_json(7), _json(8)]
    greedy_free = SamplingParams(temperature=0, max_tokens=24)
    params = [free[0], constrained[0], free[1], greedy_free, constrained[1], free[2], free[3]]
    prompts = ["def ", PROMPT, "class ", "import ", PROMPT, "for ", "while "]
    batch = llm.generate(prompts, params)
    for prompt, p, got in zip(prompts, params, batch, strict=True):
        alone = _solo(llm, prompt, p)
        assert got.token_ids == alone.token_ids, (prompt, got.text, alone.text)


def test_max_tokens_ends_with_length(llm: Any) -> None:
    out = _solo(llm, PROMPT, _json(3).model_copy(update={"max_tokens": 5}))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"name":"')


def test_stop_strings_still_apply(llm: Any) -> None:
    out = _solo(llm, PROMPT, _json(4, stop=['"age"']))
    assert out.finish_reason == "stop" and out.text.startswith('{"name":"')
    assert '"age"' not in out.text and out.text.endswith(",")


def test_grammar_end_stops_even_with_ignore_eos(llm: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True,
                            structured_output={"choice": CHOICES})
    out = _solo(llm, "x = ", params)
    assert out.finish_reason == "stop" and out.text in CHOICES


def test_uncompilable_grammar_fails_alone(llm: Any) -> None:
    engine = llm.engine
    engine.add_request("bad-regex", "x = ", SamplingParams(structured_output={"regex": "a(b"}))
    engine.add_request("ok", "x = ", SamplingParams(max_tokens=4, temperature=0))
    outs = _drain(engine)
    bad = [o for o in outs if o.request_id == "bad-regex"]
    assert len(bad) == 1 and bad[0].finished and bad[0].finish_reason == "error"
    assert bad[0].error_kind == "invalid_request" and bad[0].error.startswith("regex:")
    assert [o for o in outs if o.request_id == "ok"][-1].finish_reason == "length"


def test_request_waits_for_its_grammar_without_stalling_the_batch(llm: Any) -> None:
    """A compile that takes long holds back only its own request."""
    engine = llm.engine
    gate = threading.Event()
    engine.structured.compiler._pool.submit(gate.wait, 60)  # occupy the compile thread
    schema = {**SCHEMA, "title": "unseen schema"}  # not in the cache yet
    engine.add_request("slow", PROMPT, SamplingParams(
        temperature=0, max_tokens=120, structured_output={"json_schema": schema}))
    engine.add_request("free", "def ", SamplingParams(temperature=0, max_tokens=6))
    free_done = False
    for _ in range(50):
        for out in TextOutputs.of(engine).step():
            assert out.request_id == "free", "the constrained request ran before its grammar"
            free_done = free_done or out.finished
        if free_done:
            break
    assert free_done and engine.scheduler.requests["slow"].num_output_tokens == 0
    gate.set()
    outs = [o for o in _drain(engine) if o.request_id == "slow"]
    jsonschema.validate(json.loads("".join(o.text for o in outs)), schema)


def test_preemption_keeps_the_grammar_in_step() -> None:
    """A pool too small for the batch forces recompute; outputs equal the roomy run."""
    from worker import LLM

    params = [_json(seed) for seed in range(8)]
    roomy = LLM(device="cpu", kv_cache_blocks=256).generate([PROMPT] * 8, params)
    tight_llm = LLM(device="cpu", kv_cache_blocks=12, block_size=16)
    tight = tight_llm.generate([PROMPT] * 8, params)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for out in tight:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_resume_with_prior_output_ids(llm: Any) -> None:
    """Crash-resume: the matcher first consumes the tokens already streamed elsewhere."""
    engine = llm.engine
    full = _solo(llm, PROMPT, _json(11))
    cut = len(full.token_ids) // 2
    engine.add_request("resumed", PROMPT, _json(11), prior_output_ids=full.token_ids[:cut])
    rest = [t for o in _drain(engine) for t in o.new_token_ids]
    assert full.token_ids[:cut] + rest == full.token_ids
    wrong = engine.tokenizer("not json", add_special_tokens=False)["input_ids"]
    engine.add_request("bad-prior", PROMPT, _json(11), prior_output_ids=wrong)
    out = _drain(engine)[-1]
    assert out.finish_reason == "error" and out.error.startswith("prior_output_ids:")


@pytest.mark.parametrize("apply", [_apply_bitmask_numpy, _apply_bitmask_torch])
def test_bitmask_applies_to_constrained_rows_only(apply: Any) -> None:
    """Both paths (numpy on CPU, torch ops on a GPU) against a per-token oracle."""
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 1 may only emit token 5
    bitmask[1, 2] = -(2**31)  # row 3: token 2 * 32 + 31 = 95 is past the vocabulary...
    bitmask[1, 1] = -(2**31) | 1  # ... so only tokens 32 and 63 (bit 31: the sign bit)
    out = apply(logits, [1, 3], bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [32, 63]
    assert out[3, 32] == logits[3, 32]
    words = torch.randint(-(2**31), 2**31 - 1, (3, 257), dtype=torch.int32)
    logits = torch.randn(5, 8200)
    got = apply(logits, [0, 2, 4], words)
    for k, row in enumerate([0, 2, 4]):
        allowed = [(int(words[k, t // 32]) >> (t % 32)) & 1 for t in range(8200)]
        assert torch.isfinite(got[row]).int().tolist() == allowed
    assert torch.equal(apply_token_bitmask(logits, [0, 2, 4], words), got)


def _drain(engine: Any) -> list[TextOutput]:
    outs: list[TextOutput] = []
    while engine.has_unfinished_requests():
        outs += TextOutputs.of(engine).step()
    return outs
