"""Engine paths beyond the plain step under tensor parallelism (gloo, rank 1 spawned):
overlapped steps, suffix speculative decoding and multi-LoRA at size 2 give what one
process gives: greedy tokens equal, chosen-token logprobs within 1e-5, seeded draws equal."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.family_checkpoints import build_family
from tests.worker.engine.lora_adapters import ATTN, write_adapter
from worker.engine.llm import LLM
from worker.engine.lora.targets import base_targets

# chunked prefill (a 32-token step, 16-token chunks) in a pool small enough to preempt
ENGINE = dict(device="cpu", kv_cache_blocks=12, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, long_prefill_token_threshold=16, lean_decode=False)
PROMPT_LENS = [3, 20, 41, 9, 30]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_family("llama", tmp_path_factory.mktemp("tp_paths"))


def _rows(outs: list[Any]) -> list[list[tuple[int, float]]]:
    """[(token, chosen-token logprob)] per output (no logprobs asked: 0.0)."""
    got = []
    for out in outs:
        assert out.error is None, out.error
        lps = [float(lp[0]) for lp in out.logprobs] if out.logprobs else [0.0] * len(
            out.token_ids)
        got.append(list(zip(out.token_ids, lps, strict=True)))
    return got


def assert_same(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]
                ) -> None:
    for rid, (rows, ref) in enumerate(zip(got, want, strict=True)):
        assert [t for t, _ in rows] == [t for t, _ in ref], f"request {rid}: tokens differ"
        torch.testing.assert_close(torch.tensor([lp for _, lp in rows]),
                                   torch.tensor([lp for _, lp in ref]), rtol=0, atol=1e-5)


def _overlap_run(path: str, size: int, overlap: bool) -> list[list[tuple[int, float]]]:
    """Greedy rows with logprobs, then seeded draws at temperature 1 (logprobs too)."""
    llm = LLM(path, tensor_parallel_size=size, async_scheduling=overlap, **ENGINE)
    try:
        assert llm.engine.overlap is overlap
        rng = random.Random(5)
        vocab = llm.engine.runner.shape.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True, logprobs=0))
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"
        seeded = llm.generate(prompts[:3], [SamplingParams(
            temperature=1.0, seed=70 + i, max_tokens=8, ignore_eos=True, logprobs=0)
            for i in range(3)])
        return _rows(greedy) + _rows(seeded)
    finally:
        llm.close()


def test_overlapped_steps_under_tp2_equal_tp1(llama: str) -> None:
    """Rank 0 launches step N+1 before reading step N back; the followers run the steps
    in launch order with their placeholders filled: one process's tokens."""
    assert_same(_overlap_run(llama, 2, True), _overlap_run(llama, 1, False))


def _spec_run(path: str, size: int, spec: str) -> tuple[list[list[tuple[int, float]]], int]:
    """Rows of prompts that repeat themselves (suffix decoding drafts from them), greedy
    and seeded, and one greedy row reporting logprobs (it never drafts, so it runs beside
    the drafting rows in the verification steps); and the draft tokens accepted."""
    llm = LLM(path, tensor_parallel_size=size, speculative=spec, device="cpu",
              kv_cache_blocks=64, block_size=8, lean_decode=False)
    try:
        rng = random.Random(11)
        vocab = llm.engine.runner.shape.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] * 5 for n in (3, 4, 6, 5)]
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)]
        outs = llm.generate(prompts, params)
        spec_state = llm.engine.spec
        return _rows(outs), spec_state.accepted_tokens if spec_state is not None else 0
    finally:
        llm.close()


def test_speculative_decoding_under_tp2_equals_tp1_without_it(llama: str) -> None:
    """The verification forward runs on every rank from the broadcast step; rank 0
    drafts (suffix decoding, host-side) and samples: the tokens of no speculation, and
    the logprobs of the row that reports them."""
    want, _ = _spec_run(llama, 1, "off")
    got, accepted = _spec_run(llama, 2, "suffix")
    assert accepted > 0, "no draft was accepted: the test proves nothing"
    assert_same(got, want)


@pytest.fixture(scope="module")
def adapters(llama: str, tmp_path_factory) -> dict[str, str]:
    """Three adapters of the tiny Llama: every projection, attention only, MLP only."""
    from transformers import AutoModelForCausalLM

    base = base_targets(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32),
                        llama)
    root = tmp_path_factory.mktemp("tp_lora")
    return {"all8": write_adapter(root / "all8", base, rank=8, alpha=16, seed=1, std=0.2),
            "attn4": write_adapter(root / "attn4", base, rank=4, alpha=8, targets=ATTN,
                                   seed=2, std=0.2),
            "mlp8": write_adapter(root / "mlp8", base, rank=8, alpha=8, seed=3, std=0.2,
                                  targets=("gate_proj", "up_proj", "down_proj"))}


def _lora_run(path: str, size: int, adapters: dict[str, str]
              ) -> list[list[tuple[int, float]]]:
    """Two adapters and the base model in one batch (two slots), then the third adapter,
    registered after start, in a slot the first one held: rows with logprobs."""
    llm = LLM(path, tensor_parallel_size=size, max_loras=2, max_lora_rank=8,
              lora_modules=[f"all8={adapters['all8']}", f"attn4={adapters['attn4']}"],
              **ENGINE)
    try:
        rng = random.Random(7)
        vocab = llm.engine.runner.shape.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 20, 41, 9, 30, 12)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        first = llm.generate(prompts, params,
                             lora_name=["all8", "attn4", None, "attn4", "all8", None])
        assert llm.engine.lora is not None
        llm.engine.lora.add_adapter("mlp8", adapters["mlp8"])
        second = llm.generate(prompts[:4], params, lora_name=["mlp8", None, "all8", "mlp8"])
        return _rows(first) + _rows(second)
    finally:
        llm.close()


def test_lora_under_tp2_equals_tp1(llama: str, adapters: dict[str, str]) -> None:
    """Adapters cut like their layers, rank 0's slot writes replayed on rank 1: the rows
    of each adapter and of the base model give one process's tokens and logprobs."""
    want = _lora_run(llama, 1, adapters)
    got = _lora_run(llama, 2, adapters)
    assert_same(got, want)
    base_rows = _rows_without_lora(llama)
    assert want[1] != base_rows[1], "the adapter changed nothing: the test proves nothing"


def _rows_without_lora(path: str) -> list[list[tuple[int, float]]]:
    llm = LLM(path, **ENGINE)
    try:
        rng = random.Random(7)
        vocab = llm.engine.runner.shape.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 20, 41, 9, 30, 12)]
        return _rows(llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)))
    finally:
        llm.close()
