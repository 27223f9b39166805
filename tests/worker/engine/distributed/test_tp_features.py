"""Engine features under tensor parallelism (gloo, rank 0 here, rank 1 spawned): quantized
weights at load (INT8 on the C++ kernel and on the torch fallback, FP8, INT4), an FP8 KV
cache with and without per-layer scales, and the KV cache's host tier each give one
process's greedy tokens, chosen-token logprobs within 1e-5, with chunked prefill and
preemption in a small pool."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.family_checkpoints import build_family
from tests.worker.engine.kv.test_fp8_kv_scales import _blown_up
from worker.engine.llm import LLM
from worker.engine.runner.quant.experts import QuantizedExperts
from worker.engine.runner.quant.fp8 import Fp8Linear
from worker.engine.runner.quant.int4 import Int4Linear
from worker.engine.runner.quant.int8 import Int8Linear
from worker.engine.runner.tp_ranks import TensorParallelFault

PROMPT_LENS = [3, 20, 41, 9, 30]
ENGINE = dict(device="cpu", kv_cache_blocks=12, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, long_prefill_token_threshold=16, lean_decode=False)
QUANT_LAYERS = {"int8": Int8Linear, "fp8": Fp8Linear, "int4": Int4Linear}


def _run(path: str, size: int, **options) -> tuple[list[list[tuple[int, float]]], LLM]:
    """[(token, chosen-token logprob)] per prompt from an engine of ``size`` ranks, and
    the (closed) engine, for its counters."""
    llm = LLM(path, tensor_parallel_size=size, **{**ENGINE, **options})
    try:
        vocab = llm.engine.runner.shape.vocab_size
        rng = random.Random(11)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True, logprobs=0))
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"
        got = []
        for out in outs:
            assert out.error is None, out.error
            got.append([(tok, float(lp[0])) for tok, lp in
                        zip(out.token_ids, out.logprobs or [], strict=True)])
        return got, llm
    finally:
        llm.close()


def _assert_same(got, want, atol: float = 1e-5) -> None:
    for rid, (rows, ref) in enumerate(zip(got, want, strict=True)):
        assert [t for t, _ in rows] == [t for t, _ in ref], f"request {rid}: tokens differ"
        torch.testing.assert_close(torch.tensor([lp for _, lp in rows]),
                                   torch.tensor([lp for _, lp in ref]), rtol=0, atol=atol)


@pytest.mark.parametrize(("method", "family", "hidden", "steps"), [
    ("int8", "llama", 64, 32), ("int8", "llama", 64, 64), ("fp8", "llama", 64, 32),
    ("int4", "qwen2", 256, 32)])
def test_quantized_at_load_tp2_equals_tp1(method: str, family: str, hidden: int, steps: int,
                                          tmp_path_factory) -> None:
    """Each rank quantizes its shards to one process's numbers (INT4's 128-column groups
    need 256 attention columns: the row-parallel o_proj's shard is then 128 wide; Qwen2
    also ties its quantized head to the embedding; INT8 at 64-token steps runs the path
    that rounds to bf16 above 32 rows, see ``tp_shard.ReducedQuant``). INT4's CPU kernel
    rounds its output to bf16: the ranks' fp32 partials, summed in another order than the
    kernel's one accumulation, round to the other bf16 neighbour where the sum sits on a
    boundary (measured: 39 of 40 logprobs bit-equal, one 1.5e-3 off, all tokens equal).
    INT8's bf16 GEMM above 32 rows rounds the same way: 2e-6 on one CPU, 1.6e-5 on one
    whose GEMM runs on AMX tiles (another accumulation order), so both bf16-rounding cases
    take the near-tie tolerance; the tokens must be equal."""
    path = build_family(family, tmp_path_factory.mktemp("q"), hidden=hidden)
    # 64-token steps (48-token chunks): INT8's CPU path above 32 rows rounds to bf16
    options = dict(quantization=method, max_num_batched_tokens=steps,
                   long_prefill_token_threshold=steps * 3 // 4)
    want, _ = _run(path, 1, **options)
    got, llm = _run(path, 2, **options)
    layers = llm.engine.runner.model.model.layers[0]
    assert isinstance(layers.self_attn.q_proj, QUANT_LAYERS[method])
    assert isinstance(layers.mlp.down_proj.inner, QUANT_LAYERS[method])  # row-parallel
    rounds_to_bf16 = method == "int4" or (method == "int8" and steps > 32)
    _assert_same(got, want, atol=5e-3 if rounds_to_bf16 else 1e-5)


def test_fused_projections_quantized_at_load_tp2_equals_tp1(tmp_path_factory) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj keep whole rows of each part on a rank, so
    INT8's per-row scales are one process's."""
    path = build_family("phi3", tmp_path_factory.mktemp("qf"))
    want, _ = _run(path, 1, quantization="int8")
    got, llm = _run(path, 2, quantization="int8")
    layers = llm.engine.runner.model.model.layers[0]
    assert isinstance(layers.self_attn.qkv_proj, Int8Linear)
    assert isinstance(layers.mlp.gate_up_proj, Int8Linear)
    _assert_same(got, want)


@pytest.fixture
def no_compiler(monkeypatch):
    """INT8 without Ferry's C++ kernel (no compiler: ``CXX`` names none), in this process
    and the ranks it spawns, which inherit the environment; the cached probes are reset
    on both sides of the test."""
    from kernels.quant import cpu_int8_linear
    from worker.engine.runner.quant import int8

    monkeypatch.setenv("CXX", "ferry-no-such-compiler")
    for probe in (int8.native_kernel, cpu_int8_linear.kernel):
        probe.cache_clear()
    assert not int8.native_kernel()
    yield
    monkeypatch.undo()
    for probe in (int8.native_kernel, cpu_int8_linear.kernel):
        probe.cache_clear()


@pytest.mark.parametrize("steps", [32, 64])
def test_int8_torch_fallback_tp2_equals_tp1(steps: int, no_compiler, tmp_path_factory) -> None:
    """INT8 on the torch fallback (``torch._weight_int8pack_mm`` at up to 32 rows, its
    product scaled and rounded to bf16; the bf16 GEMM above): each row-parallel rank keeps
    its partial in fp32 and the sum is scaled and rounded once, as one process does. Above
    32 rows the bf16 GEMM's own accumulation order decides near ties (one logprob 1.7e-3
    off on a CPU with AMX, none without): the tokens must be equal."""
    path = build_family("llama", tmp_path_factory.mktemp("q8"))
    options = dict(quantization="int8", max_num_batched_tokens=steps,
                   long_prefill_token_threshold=steps * 3 // 4)
    want, _ = _run(path, 1, **options)
    got, llm = _run(path, 2, **options)
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj.inner, Int8Linear)
    _assert_same(got, want, atol=5e-3 if steps > 32 else 1e-5)


def test_int4_group_across_the_row_cut_is_refused_by_name(tmp_path_factory) -> None:
    """Llama's o_proj takes 64 columns (groups of 64), 32 per rank: no group fits."""
    path = build_family("llama", tmp_path_factory.mktemp("q4"))
    with pytest.raises(TensorParallelFault, match=r"int4 under tensor parallelism: layer "
                       r"model\.layers\.0\.self_attn\.o_proj's group size 64 does not "
                       r"divide its row-parallel shard of 32"):
        LLM(path, tensor_parallel_size=2, quantization="int4", **ENGINE)


@pytest.mark.parametrize(("method", "family"), [
    ("int8", "mixtral"), ("fp8", "mixtral"), ("int8", "qwen3_moe")])
def test_moe_experts_quantized_at_load_tp2_equals_tp1(method: str, family: str,
                                                      tmp_path_factory) -> None:
    """Each rank quantizes its slice of the experts' intermediate size: gate/up rows with
    their own scales, down rows with the maximum over both ranks' columns (one process's
    scale), so the partial outputs sum to one process's numbers."""
    path = build_family(family, tmp_path_factory.mktemp("qm"))
    want, _ = _run(path, 1, quantization=method)
    got, llm = _run(path, 2, quantization=method)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts.inner
    quantized = experts.ferry_quantized
    assert isinstance(quantized, QuantizedExperts) and quantized.method == method
    assert quantized.intermediate * 2 == _intermediate(path)  # this rank's half
    _assert_same(got, want)


def _intermediate(path: str) -> int:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def test_int4_moe_experts_at_load_are_refused_by_name(tmp_path_factory) -> None:
    """INT4's kernel rounds each expert's output to bf16, which a rank's partial cannot
    reproduce before the experts' one all-reduce: refused rather than served other
    numbers."""
    path = build_family("mixtral", tmp_path_factory.mktemp("qm4"), hidden=128)
    with pytest.raises(TensorParallelFault, match=r"int4 MoE experts \(model\.layers\.0\."
                       r"mlp\.experts\) are not implemented with tensor-parallel size 2"):
        LLM(path, tensor_parallel_size=2, quantization="int4", **ENGINE)


@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_kv_cache_tp2_equals_tp1(scaled: bool, tmp_path: Path) -> None:
    """Each rank's FP8 pool holds its heads; per-layer scales are the same on every rank.
    e4m3 has 3 mantissa bits: a key that differs in its last fp32 bit (the row-parallel
    sums of the layer before, added in another order) can round to the neighbouring e4m3
    value, 1/16 away; measured: 1.7e-6 unscaled, 2.9e-4 with the 200x keys, tokens equal."""
    path = _blown_up(tmp_path, True) if scaled else build_checkpoint("llama", tmp_path)
    want, _ = _run(path, 1, kv_cache_dtype="fp8_e4m3")
    got, llm = _run(path, 2, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    _assert_same(got, want, atol=1e-3)


def test_host_tier_tp2_equals_tp1(tmp_path: Path) -> None:
    """Preempted requests' blocks go to the host and come back on every rank alike."""
    path = build_family("llama", tmp_path)
    want, one = _run(path, 1, host_memory_bytes=1 << 20)
    got, two = _run(path, 2, host_memory_bytes=1 << 20)
    for llm in (one, two):
        tier = llm.engine.block_manager.tier
        assert tier is not None and tier.stats.restored > 0, "the tier was meant to be used"
    _assert_same(got, want)
