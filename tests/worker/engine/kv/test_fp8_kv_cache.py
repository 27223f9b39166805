"""The FP8 (e4m3) KV cache on the CPU paths: stored and read by every CPU attention path,
twice the sequences of a 16-bit cache in the same bytes, and greedy outputs that agree
with the fp32-cache path by vLLM's rule for quantized paths: the tokens agree until a
position where each side's token is within the other's top-5 logprobs.

The engine runs cover both CPU backends (``cpu`` falls back to torch for the FP8 decode
rows, ``torch``), prefix-cache hits (a repeated prompt reads its prefix from FP8 pages)
and the host tier (a pool small enough to evict cached blocks to host memory and back).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.kv_budget import KV_DTYPES

TOP = 5


def test_store_kv_writes_saturated_fp8() -> None:
    k_cache = torch.zeros(3, 4, 2, 8, dtype=reference.FP8_E4M3)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 8) * 4
    key[0, 0, 0], key[1, 1, 1] = 1000.0, -1e6  # past e4m3's largest finite value
    value = torch.randn(3, 2, 8)
    reference.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(-1, 2, 8).float(), v_cache.view(-1, 2, 8).float()
    want = key.clamp(-448, 448).to(reference.FP8_E4M3).float()
    assert torch.equal(flat_k[5], want[0]) and torch.equal(flat_k[0], want[2])
    assert flat_k[5, 0, 0] == 448.0
    assert torch.equal(flat_v[0], value[2].to(reference.FP8_E4M3).float())
    assert not flat_k[[1, 2, 3, 4, 6]].any()  # the skipped token (-1) wrote nothing


def _engine(path: str, kv: str, backend: str, **kw) -> Engine:
    kw.setdefault("max_num_batched_tokens", 64)
    return Engine(EngineConfig.create(
        path, block_size=8, max_num_seqs=32, device="cpu", attention_backend=backend,
        kv_cache_dtype=kv, **kw))


def test_fp8_pool_holds_twice_the_sequences(tmp_path_factory) -> None:
    path = build_checkpoint("llama", tmp_path_factory.mktemp("fp8pool"))
    peaks, blocks = {}, {}
    for kv in ("bfloat16", "fp8_e4m3"):
        budget = 32 * 2048  # 32 blocks of 8 tokens in bfloat16 (2 layers, 2 KV heads of 16)
        engine = _engine(path, kv, "torch", num_blocks=None, memory_bytes=budget,
                         enable_prefix_caching=False, max_num_batched_tokens=1024)
        blocks[kv] = engine.runner.num_blocks
        assert engine.runner.kv_pool.nbytes <= budget + engine.runner.bytes_per_block
        for i in range(16):  # each holds 40 + 24 tokens: 8 blocks
            engine.add_request(str(i), [1 + i] * 40, SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True))
        peaks[kv] = 0
        while engine.has_unfinished_requests():
            TextOutputs.of(engine).step()
            peaks[kv] = max(peaks[kv], len(engine.scheduler.running))
    assert blocks == {"bfloat16": 32, "fp8_e4m3": 64}
    assert peaks["fp8_e4m3"] == 2 * peaks["bfloat16"], peaks  # the pool binds: 6 and 12 today


def _run(engine: Engine, jobs, cached: dict[str, int], top: int | None = TOP,
         lora: dict[str, str] | None = None) -> dict[str, list]:
    """request id -> per token (token, its top-5 logprobs); ``cached`` gets each
    request's prompt tokens the prefix cache served (either tier); ``lora``: request id ->
    adapter."""
    out: dict[str, list[tuple[int, dict[int, float]]]] = {rid: [] for rid, _, _ in jobs}
    for rid, prompt, mt in jobs:
        engine.add_request(rid, prompt, SamplingParams(
            temperature=0, max_tokens=mt, ignore_eos=True, logprobs=top),
            lora_name=(lora or {}).get(rid))
    text = TextOutputs.of(engine)
    while engine.has_unfinished_requests():
        for o in text.step():
            lps = o.logprobs or [(0.0, [])] * len(o.new_token_ids)
            for tok, (_, best) in zip(o.new_token_ids, lps, strict=True):
                out[o.request_id].append((tok, dict(best)))
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    return out


def assert_top5_agree(got, want, label: str) -> None:
    """Tokens agree until a position where each side's token is in the other's top 5."""
    for i, ((g, g_top), (w, w_top)) in enumerate(zip(got, want, strict=True)):
        if g != w:
            assert g in w_top and w in g_top, f"{label}: token {i}: {g} vs {w}"
            return


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_greedy_agrees_with_fp32_cache(backend, tmp_path_factory) -> None:
    """Two waves on one engine: the second repeats the first's shared-prefix prompts after
    other prompts pushed their blocks out of a 30-block pool into the host tier."""
    path = build_checkpoint("llama", tmp_path_factory.mktemp("fp8exact"))
    rng = random.Random(7)
    shared = [rng.randrange(300) for _ in range(40)]
    first = [(f"a{i}", [*shared, i], 12) for i in range(2)] + [
        (f"b{i}", [rng.randrange(300) for _ in range(n)], 16) for i, n in enumerate([3, 70])]
    filler = [(f"c{i}", [rng.randrange(300) for _ in range(90)], 4) for i in range(3)]
    second = [(f"d{i}", [*shared, 7 + i], 12) for i in range(2)]
    waves = [first, filler, second]
    kw = dict(num_blocks=30, host_memory_bytes=1 << 20)
    results = {}
    for kv in ("float32", "fp8_e4m3"):
        engine = _engine(path, kv, backend, **kw)
        cached: dict[str, int] = {}
        results[kv] = {k: v for wave in waves for k, v in _run(engine, wave, cached).items()}
        assert engine.runner.kv_caches[0][0].dtype == KV_DTYPES[kv]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert cached["a1"] >= 32 and cached["d0"] >= 32  # prefix hits, the second wave's
        tier = engine.block_manager.tier
        assert tier is not None and tier.stats.offloaded and tier.stats.restored, "host tier"
    for wave in waves:
        for rid, _, mt in wave:
            assert len(results["fp8_e4m3"][rid]) == mt
            assert_top5_agree(results["fp8_e4m3"][rid], results["float32"][rid], rid)


def test_speculative_decoding_on_fp8(tmp_path_factory) -> None:
    """Speculation on an FP8 cache: its tokens agree with speculation off's until one that
    is within the other run's top 5 (speculation skips rows that ask for logprobs, so the
    rule is checked one way). Not token for token: a
    verification chunk computes a token's K/V in another grouping of rows than a plain
    decode does, and a last-bit fp32 difference can cross an e4m3 rounding boundary (a
    whole FP8 step), where an fp32 or bf16 cache keeps it a last-bit difference."""
    from tests.worker.engine.speculative.test_spec_decode import _engine as spec_engine
    from tests.worker.engine.speculative.test_spec_decode import _prompts

    path = build_checkpoint("llama", tmp_path_factory.mktemp("fp8spec"))
    prompts = _prompts(300, 9)
    waves = [[(f"{tag}{i}", p, 24) for i, p in enumerate(prompts)] for tag in "ab"]
    outs = {}
    for spec in (False, True):
        engine = spec_engine(path, spec, kv_cache_dtype="fp8_e4m3")
        outs[spec] = {k: v for wave in waves
                      for k, v in _run(engine, wave, {}, None if spec else TOP).items()}
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        assert (engine.spec is not None) == spec
    assert engine.stats().spec_accepted_tokens > 0
    for rid in outs[False]:
        assert len(outs[True][rid]) == 24
        for i, ((got, _), (want, top)) in enumerate(zip(outs[True][rid], outs[False][rid],
                                                        strict=True)):
            if got != want:
                assert got in top, f"{rid}: token {i}: {got} vs {want}"
                break


def test_env_selects_fp8() -> None:
    cfg = EngineConfig.from_env("m", {"FERRY_KV_CACHE_DTYPE": "fp8_e4m3"})
    assert cfg.cache.kv_cache_dtype == "fp8_e4m3"
    assert KV_DTYPES["fp8"] == KV_DTYPES["fp8_e4m3"] == torch.float8_e4m3fn  # vLLM's alias


def test_other_fp8_formats_are_refused_by_name(tmp_path) -> None:
    path = build_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype must be .*fp8_e4m3.*got 'fp8_e5m2'"):
        _engine(path, "fp8_e5m2", "torch")


def test_lora_on_fp8(tmp_path_factory) -> None:
    """Two adapters and the base model in one batch on an FP8 cache against the fp32 cache."""
    from tests.worker.engine.lora_adapters import write_adapter
    from worker.engine.lora.targets import base_targets

    root = tmp_path_factory.mktemp("fp8lora")
    path = build_checkpoint("llama", root)
    from transformers import AutoModelForCausalLM

    base = base_targets(AutoModelForCausalLM.from_pretrained(path), path)
    modules = [f"a{i}={write_adapter(root / f'a{i}', base, rank=8, alpha=16, seed=i, std=0.15)}"
               for i in range(2)]
    rng = random.Random(3)
    jobs = [(f"q{i}", [rng.randrange(300) for _ in range(n)], 10)
            for i, n in enumerate([3, 17, 40, 9, 25, 5])]
    names = {f"q{i}": f"a{i % 3}" for i in range(6) if i % 3 < 2}  # q2, q5: the base model
    outs = {}
    for kv in ("float32", "fp8_e4m3"):
        engine = _engine(path, kv, "cpu", num_blocks=64, max_loras=2, max_lora_rank=8,
                         lora_modules=modules)
        outs[kv] = _run(engine, jobs, {}, lora=names)
    for rid, _, mt in jobs:
        assert len(outs["fp8_e4m3"][rid]) == mt
        assert_top5_agree(outs["fp8_e4m3"][rid], outs["float32"][rid], rid)
