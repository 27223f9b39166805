"""Greedy outputs equal transformers ``generate`` on each request alone (fp32).

32+ requests with mixed prompt lengths (some longer than the token budget) and mixed
max_tokens, half admitted while the first half decodes, on a KV pool small enough to
force preemption. A divergence is accepted only at a near-tie: the reference's top-2
logprob gap at that position is below 1e-3 (the rule vLLM's tests use).
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

NEAR_TIE = 1e-3


def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from transformers, plus the top-2 logprob gap at each step."""
    ids = torch.tensor([prompt])
    out = model.generate(  # explicit mask: prompts may contain the pad id
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
        do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for score in out.scores:
        top2 = torch.log_softmax(score[0].float(), -1).topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def assert_matches(got: list[int], want: list[int], gaps: list[float], label: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            assert gaps[i] < NEAR_TIE, f"{label}: token {i} differs ({g} vs {w}), gap {gaps[i]}"
            return
    assert len(got) == len(want), f"{label}: {len(got)} tokens, expected {len(want)}"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
    cfg = EngineConfig.create(
        path, num_blocks=40, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
        long_prefill_token_threshold=40, device="cpu", attention_backend="cpu",
    )
    engine = Engine(cfg)
    vocab = engine.runner.shape.vocab_size
    rng = random.Random(sum(map(ord, arch)))
    jobs = []
    for i in range(34):
        plen = rng.choice([1, 3, 9, 17, 33, 70, 130]) if i % 5 else rng.randint(65, 200)
        jobs.append((f"{arch}-{i}", [rng.randrange(vocab) for _ in range(plen)],
                     rng.choice([1, 2, 7, 16, 40])))
    results: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    finish: dict[str, str] = {}

    def drain(steps: int | None) -> None:
        n = 0
        while engine.has_unfinished_requests() and (steps is None or n < steps):
            for out in TextOutputs.of(engine).step():
                results[out.request_id] += out.new_token_ids
                if out.finished:
                    finish[out.request_id] = out.finish_reason
            n += 1

    params = lambda mt: SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)  # noqa: E731
    for rid, prompt, mt in jobs[:17]:
        engine.add_request(rid, prompt, params(mt))
    drain(6)  # the second half arrives while the first half decodes
    for rid, prompt, mt in jobs[17:]:
        engine.add_request(rid, prompt, params(mt))
    drain(None)

    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # like ignore_eos, without masking EOS
    for rid, prompt, mt in jobs:
        assert finish[rid] == "length"
        want, gaps = reference_greedy(ref, prompt, mt)
        assert_matches(results[rid], want, gaps, rid)
