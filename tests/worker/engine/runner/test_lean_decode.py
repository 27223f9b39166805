"""The lean decode path (worker/engine/runner/cpu/lean_decode.py), with small steps on one
thread (step_threads.py), gives the module path's logits on all the configured threads
bit for bit: one stream and a batch of three, the rotary table grown past its first size,
and speculative decoding's verification steps (rows of 1 + k query tokens over a cached
prefix, with the drafts' logits kept); and the lean path stays off where it would not
reproduce the modules."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.family_checkpoints import build_family
from tests.worker.engine.lora_adapters import ATTN, write_adapter
from worker import Engine, EngineConfig
from worker.engine.lora.targets import base_targets
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.cpu import layer_plan, lean_decode, lean_probe
from worker.models import default_model_path

PROMPTS = [[5, 17, 300, 41], [9] * 11, [1000, 2, 3]]


@pytest.fixture(autouse=True)
def _free_engines() -> Iterator[None]:
    """Engines hold reference cycles: free each test's KV pools before the next test's."""
    yield
    gc.collect()


def _logits_per_step(engine: Engine, prompts: list[list[int]], max_tokens: int,
                     adapters: list[str | None] | None = None,
                     ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits (cloned) and each request's tokens (request i on
    ``adapters[i]`` when given)."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = execute(*args, **kwargs)
        seen.append(out.clone())
        return out

    engine.runner.execute = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params,
                           lora_name=adapters[i] if adapters else None)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            tokens[out.request_id] += out.new_token_ids
    return seen, list(tokens.values())


def _engine(lean: bool, path: str | None = None, **kw: Any) -> Engine:
    kw.setdefault("num_blocks", 64)  # 1024 cached tokens: plenty, and small
    return Engine(EngineConfig.create(path or default_model_path(), device="cpu",
                                      block_size=16, lean_decode=lean, **kw))


# every weak match drafts (the back-off all but off), so most steps verify
SPEC: dict[str, Any] = dict(speculative="suffix", num_speculative_tokens=6, min_match_tokens=1,
            draft_token_cost=1e-3, draft_step_cost=0.0, num_blocks=64)


def _count_lean_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps the lean path runs: [all of them, those with a verification row]."""
    counts = [0, 0]
    forward = lean_decode.LeanDecode.__call__

    def counted(self, input_ids, positions, meta, kv_caches, sample_rows):  # type: ignore[no-untyped-def]
        counts[0] += 1
        counts[1] += meta.num_decodes < len(meta.seq_lens_host)
        return forward(self, input_ids, positions, meta, kv_caches, sample_rows)

    monkeypatch.setattr(lean_decode.LeanDecode, "__call__", counted)
    return counts


def _assert_same_steps(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Every step's logits bit for bit."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-stream", "batch-3"])
def test_logits_bitwise_equal_to_modules(prompts: list[list[int]],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    lean, plain = _engine(True), _engine(False)
    assert lean.runner.lean is not None and plain.runner.lean is None
    plain.runner.serial_tokens = 0  # the reference runs every step on all the threads
    calls = _count_lean_steps(monkeypatch)
    got, got_tokens = _logits_per_step(lean, prompts, 80)  # past the 64-row rope table
    want, want_tokens = _logits_per_step(plain, prompts, 80)
    assert calls[0] >= 70, "the decode steps were meant to take the lean path"
    assert got_tokens == want_tokens
    _assert_same_steps(got, want)
    assert lean.runner.serial_tokens >= len(prompts), "the steps were meant to be serial"
    assert torch.get_num_threads() == threads  # a small step's one thread is its own


def test_off_for_other_architectures(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A family ``layer_plan`` does not describe (Qwen2-MoE's shared expert) keeps the
    module path, and the plan says why."""
    path = build_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))
    engine = _engine(True, path)
    assert engine.runner.lean is None
    assert lean_decode.build_lean_decode(engine.runner.model, engine.runner.backend) is None
    assert "qwen2_moe" in str(layer_plan.build(engine.runner.model))


@pytest.mark.parametrize("family", [None, "qwen3", "gemma3"])
def test_lora_rows_bitwise_equal_to_modules(family: str | None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With multi-LoRA on, the lean path is built over the adapters' wrappers: a decode
    batch mixing two adapters and the base model gives the module path's logits (the
    default model; Qwen3's q/k norms and Gemma 3's sandwich norms over adapted
    projections)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path() if family is None else build_family(family, tmp_path)
    prompts = PROMPTS if family is None else [[5, 17, 300, 41], [9] * 11, [100, 2, 3]]
    base = base_targets(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                        path)
    modules = [f"all={write_adapter(tmp_path / 'all', base, rank=8, seed=1)}",
               f"attn={write_adapter(tmp_path / 'attn', base, rank=16, targets=ATTN, seed=2)}"]
    lora: dict[str, Any] = dict(max_loras=2, max_lora_rank=16, lora_modules=modules)
    lean, plain = _engine(True, path, **lora), _engine(False, path, **lora)
    assert lean.runner.lean is not None and plain.runner.lean is None
    plain.runner.serial_tokens = 0
    calls = _count_lean_steps(monkeypatch)
    names: list[str | None] = ["all", None, "attn"]
    got, got_tokens = _logits_per_step(lean, prompts, 12, names)
    want, want_tokens = _logits_per_step(plain, prompts, 12, names)
    assert calls[0] >= 10, "the decode steps were meant to take the lean path"
    plain_base, base_tokens = _logits_per_step(_engine(True, path), prompts, 12)
    assert got_tokens == want_tokens
    _assert_same_steps(got, want)
    assert got_tokens[1] == base_tokens[1]  # the base row is the base model's
    # the two adapters' rows moved (their tokens need not: a tiny Gemma repeats its last
    # token)
    assert got[-1].shape == plain_base[-1].shape == (3, got[-1].shape[1])
    assert int((got[-1] != plain_base[-1]).any(-1).sum()) >= 2


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["one-stream", "batch-3"])
def test_verification_steps_bitwise_equal_to_modules(prompts: list[list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # each step on the same threads: the prompts' prefill steps (step 0) are not bit-stable
    # across thread counts, on either path
    lean, lean_steps = _lean_equals_modules(prompts, 60, SPEC, monkeypatch)
    assert lean_steps >= 5, "verification steps were meant to take the lean path"
    assert lean.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_family_verification_steps_bitwise_equal_to_modules(
        family: str, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification rows on the other layer shapes: Gemma 2's soft caps (its short chunks
    attended by the backend, as the module path has them), Phi-3's fused projections,
    Qwen3-MoE's q/k norms and MoE blocks."""
    path = build_family(family, tmp_path_factory.mktemp(family))
    prompts = [[5, 17, 300, 41], [9] * 11, [100, 2, 3]]
    lean, lean_steps = _lean_equals_modules(prompts, 40, SPEC, monkeypatch, path)
    assert lean_steps >= 5, "verification steps were meant to take the lean path"
    assert lean.runner.lean is not None and lean.runner.lean.plan.family == family


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_bf16_bitwise_equal_to_modules(family: str, tmp_path_factory: pytest.TempPathFactory,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 too, where each formula's casts decide the bits (Gemma's norm casts
    after its scale, Llama's before; the rotary tables stay in the model's dtype)."""
    path = build_family(family, tmp_path_factory.mktemp(family))
    prompts = [[5, 17, 300, 41], [9] * 11, [100, 2, 3] * 7]
    kw: dict[str, Any] = dict(dtype="bfloat16")
    lean, _ = _lean_equals_modules(prompts, 20, kw, monkeypatch, path)
    assert lean.runner.lean.dtype == torch.bfloat16


def test_probe_keeps_a_wrong_description_off(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A description that misses a feature (Gemma 2 without its attention soft cap) is
    caught by the load-time probe: the model keeps the module path."""
    path = build_family("gemma2", tmp_path)
    engine = _engine(True, path)
    assert engine.runner.lean is not None  # the true description passes the probe
    wrong = dataclasses.replace(layer_plan.FAMILIES["gemma2"], attn_soft_cap=False)
    monkeypatch.setitem(layer_plan.FAMILIES, "gemma2", wrong)
    model, backend = engine.runner.model, engine.runner.backend
    assert lean_decode.build_lean_decode(model, backend, probe=False) is not None
    assert lean_decode.build_lean_decode(model, backend) is None
    reason = lean_probe.probe_mismatch(
        model, lean_decode.build_lean_decode(model, backend, probe=False), backend)
    assert reason is not None and "differs from the module path" in reason
    assert _engine(True, path).runner.lean is None


def test_off_where_the_plan_lacks_a_feature() -> None:
    """A described family with a feature the plan does not copy keeps the module path:
    a rope whose frequencies follow the sequence length, a norm class it has no copy of;
    and a family it does not describe."""
    import transformers

    small: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2)
    dynamic = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **small, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)))
    assert "changes with the sequence length" in str(layer_plan.build(dynamic))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert isinstance(layer_plan.build(llama), layer_plan.ModelPlan)
    llama.model.norm = torch.nn.LayerNorm(32)
    assert "LayerNorm" in str(layer_plan.build(llama))
    llama.config.model_type = "olmo2"  # type: ignore[misc]
    assert "no lean description" in str(layer_plan.build(llama))


def _lean_equals_modules(prompts: list[list[int]], steps: int, kw: dict[str, Any],
                         monkeypatch: pytest.MonkeyPatch, path: str | None = None,
                         ) -> tuple[Any, int]:
    """Run ``prompts`` on a lean and a module-path engine; assert the same tokens and the
    same logits step for step, and that every step took the lean path. The lean engine and
    how many of its steps carried a verification or chunk row."""
    lean, plain = _engine(True, path, **kw), _engine(False, path, **kw)
    calls = _count_lean_steps(monkeypatch)
    got, got_tokens = _logits_per_step(lean, prompts, steps)
    want, want_tokens = _logits_per_step(plain, prompts, steps)
    assert calls[0] == len(got), "some steps took the module path"
    assert got_tokens == want_tokens
    _assert_same_steps(got, want)
    return lean, calls[1]


def test_prefill_and_mixed_steps_bitwise_equal_to_modules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill steps take the lean path too, their chunks attended by the backend as the
    module path's attention hook has them attended: a fresh prompt, a prompt chunked over
    its own first chunk (a chunk that samples nothing, then one over a cached prefix), a
    prefix-cache hit with a long new part, all mixed with the others' decodes."""
    shared = [7 + i % 50 for i in range(64)]
    prompts = [list(range(3, 43)), shared + [900 + i for i in range(70)],
               [11 + (i * 7) % 400 for i in range(150)], shared + [500 + i for i in range(40)]]
    kw: dict[str, Any] = dict(max_num_batched_tokens=96, long_prefill_token_threshold=96)
    lean, lean_steps = _lean_equals_modules(prompts, 20, kw, monkeypatch)
    assert lean_steps >= 3, "prefill steps were meant to take the lean path"
    assert lean.stats().prefix_cache_hits > 0
