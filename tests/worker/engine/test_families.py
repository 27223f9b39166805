"""Every model family Ferry serves, token for token and logprob for logprob against
transformers (fp32), with each family's own features shrunk until they bite
(``tests/family_checkpoints.py``): sliding windows, soft caps, attention sinks, chunked
local attention, NoPE temperature tuning, MoE blocks, rope scaling, multi-head latent
attention (keys and values of different widths).

Five requests of mixed lengths (contexts up to ~50 tokens: past a window or chunk of 16
several times) run in one engine with chunked prefill (a 32-token budget) on a pool small
enough to force preemption. Each chosen token's logprob must be within 1e-4 of the one
transformers gives; tokens must be equal, except at a near-tie (top-2 gap < 1e-3), after
which the request is not compared further. Paths: the modules' path (every family), the
static-buffer decode path a CUDA graph replays (every family), the lean CPU decode path
(the families it describes, taken at every step and equal to the module path bit for
bit; off, decided at load, for the rest), the pure-torch backend and the Triton kernels
(interpreted) for the families whose attention has something SDPA or the kernels'
defaults lack.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.family_checkpoints import FAMILIES, build_family
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.attention.interface import triton_interpreting
from worker.engine.runner.cpu import layer_plan, lean_decode, lean_probe

NEAR_TIE = 1e-3
LOGPROB_ATOL = 1e-4
PROMPT_LENS = [3, 20, 41, 9, 30]
MAX_TOKENS = 8
# the features SDPA or the default kernel path do not have
SPECIAL = ["gpt_oss", "llama4", "gemma2", "deepseek_v3"]
# the families the lean CPU decode path describes (worker/engine/runner/cpu/layer_plan.py)
LEAN = ["llama", "llama_rope3", "mistral", "qwen2", "qwen2_window", "qwen3", "gemma2",
        "gemma3", "phi3", "phi3_partial", "mixtral", "qwen3_moe", "qwen3_moe_dense"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _prompts(vocab: int, family: str) -> list[list[int]]:
    rng = random.Random(sum(map(ord, family)))
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


def run_engine(path: str, family: str, *, static: bool = False, **kw: object
               ) -> tuple[dict[int, list[tuple[int, float]]], Engine]:
    """(request -> [(token, logprob)], engine) for the five prompts in one engine."""
    opts: dict[str, object] = dict(device="cpu", attention_backend="cpu", lean_decode=False)
    opts.update(kw)
    engine = Engine(EngineConfig.create(
        path, num_blocks=12, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
        long_prefill_token_threshold=16, **opts))
    if static:
        engine.runner.use_static_decode()
    vocab = engine.runner.shape.vocab_size
    for i, prompt in enumerate(_prompts(vocab, family)):
        engine.add_request(str(i), prompt, SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    got: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(PROMPT_LENS))}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            assert out.error is None, out.error
            lps = out.logprobs or []
            for token, lp in zip(out.new_token_ids, lps, strict=True):
                got[int(out.request_id)].append((token, float(lp[0])))  # (logprob, top)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got, engine


_REFERENCE: dict[str, dict[int, list[tuple[int, float, float]]]] = {}


def reference(path: str, family: str) -> dict[int, list[tuple[int, float, float]]]:
    """request -> [(token, logprob, top-2 gap)] from transformers' eager ``generate``."""
    if family in _REFERENCE:
        return _REFERENCE[family]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    vocab = model.config.get_text_config().vocab_size
    out: dict[int, list[tuple[int, float, float]]] = {}
    for i, prompt in enumerate(_prompts(vocab, family)):
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        rows = []
        for token, logits in zip(gen.sequences[0, len(prompt):].tolist(), gen.logits,
                                 strict=True):
            lp = torch.log_softmax(logits[0].float(), -1)
            top2 = lp.topk(2).values
            rows.append((token, float(lp[token]), float(top2[0] - top2[1])))
        out[i] = rows
    _REFERENCE[family] = out
    return out


def assert_matches(got: dict[int, list[tuple[int, float]]],
                   want: dict[int, list[tuple[int, float, float]]], label: str) -> None:
    worst = 0.0
    for rid, rows in want.items():
        assert len(got[rid]) == len(rows), f"{label}/{rid}: {len(got[rid])} tokens"
        for j, ((tok, lp), (ref_tok, ref_lp, gap)) in enumerate(zip(got[rid], rows,
                                                                   strict=True)):
            if tok != ref_tok:
                assert gap < NEAR_TIE, f"{label}/{rid}: token {j} is {tok}, not {ref_tok}"
                break
            assert math.isfinite(lp), f"{label}/{rid}: token {j} logprob {lp}"
            worst = max(worst, abs(lp - ref_lp))
            assert abs(lp - ref_lp) <= LOGPROB_ATOL, (
                f"{label}/{rid}: token {j} logprob {lp} vs {ref_lp}")
    assert worst <= LOGPROB_ATOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_path_matches_transformers(family, root):
    path = build_family(family, root)
    got, _ = run_engine(path, family)
    assert_matches(got, reference(path, family), family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_decode_path_matches_transformers(family, root):
    """Pure-decode steps through the static buffers a CUDA graph replays (uncaptured)."""
    path = build_family(family, root)
    got, engine = run_engine(path, family, static=True)
    assert engine.runner.graphs is not None
    assert_matches(got, reference(path, family), f"{family} static")


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the steps the lean decode path runs."""
    calls: list[int] = []
    forward = lean_decode.LeanDecode.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(lean_decode.LeanDecode, "__call__", counted)
    return calls


@pytest.mark.parametrize("family", LEAN)
def test_lean_path_taken_and_equal_to_modules(family, root, lean_calls):
    """The lean path is taken (built at load, every step through it) and gives the module
    path's tokens and logprobs exactly, under chunked prefill and preemption."""
    path = build_family(family, root)
    got, engine = run_engine(path, family, lean_decode=True)
    assert engine.runner.lean is not None, "the lean decode path was not built"
    assert len(lean_calls) > MAX_TOKENS, "the lean decode path never ran"
    # and the load-time probe's steps
    assert len(lean_calls) == engine.steps + lean_probe.STEPS, "some steps took the module path"
    want, _ = run_engine(path, family)
    assert got == want, f"{family}: the lean path differs from the module path"
    assert_matches(got, reference(path, family), f"{family} lean")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in LEAN])
def test_lean_path_off_for_the_rest(family, root):
    """Families the lean path does not describe are decided at load: module path."""
    path = build_family(family, root)
    engine = Engine(EngineConfig.create(path, device="cpu", num_blocks=8, block_size=8,
                                        lean_decode=True))
    assert engine.runner.lean is None
    assert isinstance(layer_plan.build(engine.runner.model), str)


@pytest.mark.parametrize("family", SPECIAL)
def test_torch_backend_matches_transformers(family, root):
    path = build_family(family, root)
    got, _ = run_engine(path, family, attention_backend="torch")
    assert_matches(got, reference(path, family), f"{family} torch")


@pytest.mark.parametrize("family", ["gpt_oss", "llama4", "deepseek_v3"])
def test_triton_backend_matches_transformers(family, root):
    if not triton_interpreting():
        pytest.skip("the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    path = build_family(family, root)
    got, _ = run_engine(path, family, attention_backend="triton")
    assert_matches(got, reference(path, family), f"{family} triton")
