"""The paged engine under tensor parallelism: ``LLM(path, tensor_parallel_size=2)`` on
gloo (rank 0 here, rank 1 a spawned process) gives the tokens of one process, chosen-token
logprobs within 1e-5, for tiny Llama, Qwen3, Mixtral and gpt-oss checkpoints (and
Mistral, Qwen2, Qwen2-MoE, Qwen3-MoE, Gemma 2, OLMo 2, OLMoE, Llama 4, DeepSeek-V3, and
the dense families with layouts of their own: Gemma 3, Granite, SmolLM3, StarCoder2, Qwen2
with a window, Phi-3, GLM-4, Cohere, Cohere 2, GPT-NeoX), with prompts
longer than a step's token budget (chunked prefill) in a pool small enough to preempt."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.family_checkpoints import build_family
from worker.engine.config import EngineConfig
from worker.engine.distributed.tp_config import TensorParallelError
from worker.engine.engine import Engine
from worker.engine.llm import LLM
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.tp_checks import check_tensor_parallel

# the four the plan was written for, then the served types it also proves out on
FAMILIES = ["llama", "qwen3", "mixtral", "gpt_oss", "mistral", "qwen2", "qwen2_moe",
            "qwen3_moe", "gemma2"]
# the dense families with their own layouts (fused projections, biases, per-head norms)
FAMILIES += ["gemma3", "granite", "smollm3", "starcoder2", "qwen2_window", "phi3",
             "phi3_partial", "glm4", "cohere", "cohere2", "gpt_neox"]
KV_HEADS_PER_RANK = {"gpt_neox": 2}  # 4 heads, no GQA: 2 each; the others 2 KV heads, 1 each
# q/k norms over the whole projection width: one all-reduce of the squares per norm
FAMILIES += ["olmo2", "olmoe"]
# Llama 4 (text): chunked attention, NoPE layers, per-head qk norm, batched experts and a
# shared expert; DeepSeek-V3 (and V2-Lite's shape): MLA by heads over a replicated latent
FAMILIES += ["llama4", "deepseek_v3", "deepseek_v3_lite"]
PROMPT_LENS = [3, 20, 41, 9, 30]
MAX_TOKENS = 8
# 12 blocks of 8 tokens for 5 requests of up to 49 tokens: some are preempted; a step
# takes 32 tokens, a prompt chunk 16: the long prompts are prefilled over several steps
ENGINE = dict(device="cpu", kv_cache_blocks=12, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, long_prefill_token_threshold=16, lean_decode=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_families")


def _generate(path: str, family: str, size: int, local_kv_heads: int | None = None,
              **extra: Any) -> list[list[tuple[int, float]]]:
    """[(token, chosen-token logprob)] per prompt, from one engine of ``size`` ranks."""
    llm = LLM(path, tensor_parallel_size=size, **ENGINE, **extra)
    try:
        vocab = llm.engine.runner.shape.vocab_size
        rng = random.Random(sum(map(ord, family)))
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True, logprobs=0))
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"
        if size > 1:  # this rank's KV pool holds its share of the KV heads
            assert llm.engine.runner.shape.num_kv_heads == (
                local_kv_heads or KV_HEADS_PER_RANK.get(family, 1))
        got = []
        for out in outs:
            assert out.error is None, out.error
            got.append([(tok, float(lp[0])) for tok, lp in
                        zip(out.token_ids, out.logprobs or [], strict=True)])
        return got
    finally:
        llm.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_engine_equals_tp1(family: str, root) -> None:
    path = build_family(family, root)
    want = _generate(path, family, 1)
    got = _generate(path, family, 2)
    for rid, (rows, ref) in enumerate(zip(got, want, strict=True)):
        assert [t for t, _ in rows] == [t for t, _ in ref], f"{family}/{rid}: tokens differ"
        torch.testing.assert_close(torch.tensor([lp for _, lp in rows]),
                                   torch.tensor([lp for _, lp in ref]), rtol=0, atol=1e-5)


def test_mla_expanded_cache_tp2_equals_tp1(root) -> None:
    """MLA with the per-head (expanded) cache: each rank caches K and V of its 2 of the 4
    heads (the latent cache, every rank the whole latent, is the family test above)."""
    path = build_family("deepseek_v3", root)
    want = _generate(path, "deepseek_v3", 1, mla_latent_cache=False)
    got = _generate(path, "deepseek_v3", 2, local_kv_heads=2, mla_latent_cache=False)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    torch.testing.assert_close(torch.tensor([[lp for _, lp in r] for r in got]),
                               torch.tensor([[lp for _, lp in r] for r in want]),
                               rtol=0, atol=1e-5)


def test_a_quantized_checkpoint_passes_the_start_checks(root) -> None:
    """Served sharded (test_tp_quant_checkpoints.py): what it cannot serve is refused at
    load, by layer (quant/tp_checkpoint.py), not at start for being quantized."""
    from transformers import AutoConfig

    path = build_family("llama", root)
    hf_config = AutoConfig.from_pretrained(path)
    hf_config.quantization_config = {"quant_method": "awq", "bits": 4}
    config = EngineConfig.create(path, tensor_parallel_size=2, device="cpu")
    check_tensor_parallel(config, hf_config)


def test_a_multimodal_llama4_is_refused_by_name() -> None:
    """Only Llama 4's text model is proven sharded: the wrapper with a vision tower is
    refused before any rank starts, rather than its tower cut by the text plan."""
    from transformers import Llama4Config

    hf_config = Llama4Config(text_config=dict(num_attention_heads=4, num_key_value_heads=2))
    config = EngineConfig.create("m", tensor_parallel_size=2, device="cpu")
    with pytest.raises(TensorParallelError, match="a multimodal checkpoint .*'llama4'.*"
                       "text 'llama4_text'.*tensor-parallel size 2"):
        check_tensor_parallel(config, hf_config)


def test_heads_that_do_not_divide_are_refused_naming_both(root) -> None:
    config = EngineConfig.create(build_family("llama", root), tensor_parallel_size=3,
                                 device="cpu")
    with pytest.raises(TensorParallelError, match="size 3 does not divide the model's 4"):
        LLM(config.model.model, tensor_parallel_size=3, device="cpu")


def test_size_from_the_environment() -> None:
    config = EngineConfig.from_env("m", env={"FERRY_TENSOR_PARALLEL_SIZE": "2"})
    assert config.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.create("m", tensor_parallel_size=0)


def _cached_run(path: str, size: int) -> tuple[list[Any], list[int], list[list[int]]]:
    """A request with prompt logprobs, then two sharing its 24-token prefix (3 blocks of
    the prefix cache): (prompt logprobs, cached prompt tokens, tokens) per request."""
    engine = Engine(EngineConfig.create(path, tensor_parallel_size=size, block_size=8,
                                        num_blocks=64, **{k: v for k, v in ENGINE.items()
                                                          if k in ("device", "lean_decode")}))
    try:
        rng = random.Random(3)
        prefix = [rng.randrange(engine.runner.shape.vocab_size) for _ in range(24)]
        prompt_lps: list[Any] = []
        cached: list[int] = []
        tokens: list[list[int]] = []
        for i, tail in enumerate(([5, 6], [7], [9, 10, 11])):
            engine.add_request(str(i), prefix + tail, SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True,
                prompt_logprobs=0 if i == 0 else None))
            got: list[int] = []
            while engine.has_unfinished_requests():
                for out in TextOutputs.of(engine).step():
                    got += out.new_token_ids
                    if out.prompt_logprobs is not None:
                        prompt_lps = [lp for _, lp, _ in out.prompt_logprobs]
                    if out.finished:
                        cached.append(out.num_cached_tokens)
            tokens.append(got)
        return prompt_lps, cached, tokens
    finally:
        engine.close()


def test_prefix_cache_and_prompt_logprobs_under_tp2(root) -> None:
    path = build_family("llama", root)
    want_lps, want_cached, want_tokens = _cached_run(path, 1)
    got_lps, got_cached, got_tokens = _cached_run(path, 2)
    assert got_tokens == want_tokens
    assert got_cached == want_cached and min(got_cached[1:]) >= 16  # hits, not recomputed
    assert got_lps[0] is None and len(got_lps) == 26
    torch.testing.assert_close(torch.tensor(got_lps[1:]), torch.tensor(want_lps[1:]),
                               rtol=0, atol=1e-5)


def test_seeded_sampling_and_structured_output_under_tp2(root) -> None:
    """Rank 0 samples from the gathered logits: seeded draws at temperature 1 and a regex
    constraint give one process's text."""
    path = build_family("llama", root)
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=12, ignore_eos=True,
                             structured_output={"regex": "[a-e]{3,6}-[0-9]{2}"} if i else None)
              for i in range(3)]
    texts = []
    for size in (1, 2):
        llm = LLM(path, tensor_parallel_size=size, device="cpu", kv_cache_blocks=64)
        try:
            outs = llm.generate(["def f(x):", "The fox", "Name: "], params)
            texts.append([(o.token_ids, o.text) for o in outs])
        finally:
            llm.close()
    assert texts[1] == texts[0]
    assert re.fullmatch("[a-e]{3,6}-[0-9]{2}", texts[1][1][1])


def test_a_model_type_without_a_proven_plan_is_refused_by_name(root) -> None:
    from transformers import FalconConfig  # a fused multi-query qkv no plan here cuts

    config = EngineConfig.create(build_family("llama", root), tensor_parallel_size=2,
                                 device="cpu")
    with pytest.raises(TensorParallelError, match="model type 'falcon'.*tensor-parallel size 2"):
        check_tensor_parallel(config, FalconConfig(num_attention_heads=4))
