"""One row's adapter never reaches another row: an adapter whose weights hold a NaN or an
Inf, installed straight into a slot (past the load check), leaves every other row's
logits bit for bit what they are beside a clean adapter of the same shapes.

The default model through the ``Engine``, fp32 on CPU, on each of its LoRA paths: the
lean CPU decode and the module path (every slot in use at once for small steps), one
matmul pair per adapter (``WIDE_MAX_TOKENS`` set to 0), and the static decode path
(the Triton kernels under the interpreter). Requests: the base model, a clean adapter,
and the bad adapter (or, for the reference run, its clean twin) in the slot beside the
clean one's, so the CPU's every-slot product spans it.

The bad adapter's rows also write NaN keys and values into their KV blocks: requests
that take those blocks after it finished must not read them, on either CPU attention
backend, and no decode attention path may read a cache position a row does not own.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.worker.engine.lora_adapters import write_adapter
from worker import Engine, EngineConfig
from worker.engine.lora import metadata
from worker.engine.lora.adapter import LoraAdapter
from worker.engine.lora.slots import slot_key
from worker.engine.lora.targets import BaseTargets, base_targets
from worker.engine.output.text_output import TextOutputs
from worker.models import default_model_path

PROMPTS = {"base": [5, 17, 300, 41, 9], "clean": [9] * 11, "bad": [1000, 2, 3, 77]}
STEPS = 6


@pytest.fixture(autouse=True)
def _free_engines() -> Iterator[None]:
    """Engines hold reference cycles: free each test's KV pools before the next test's."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseTargets, str, str]:
    """(the base's targets, a clean adapter, the bad one's clean twin): their paths."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-isolation")
    path = default_model_path()
    base = base_targets(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), path)
    return (base, write_adapter(root / "clean", base, rank=8, seed=1),
            write_adapter(root / "twin", base, rank=16, seed=2))


def poisoned(adapter: LoraAdapter, value: float) -> LoraAdapter:
    """``adapter`` with ``value`` in one entry of every A and every B."""
    weights = {}
    for module, (a, b) in adapter.weights.items():
        a, b = a.clone(), b.clone()
        a[1, 3] = value
        b[2, 1] = value
        weights[module] = (a, b)
    return dataclasses.replace(adapter, name="bad", weights=weights)


def _engine(adapters: tuple[BaseTargets, str, str], value: float | None, lean: bool
            ) -> Engine:
    """The engine with ``clean`` registered and ``bad`` installed: the twin's weights
    with ``value`` in them (the twin itself for ``None``)."""
    _, clean, twin = adapters
    engine = Engine(EngineConfig.create(
        default_model_path(), device="cpu", block_size=16, num_blocks=64, lean_decode=lean,
        max_loras=3, max_lora_rank=16, lora_modules=[f"clean={clean}"]))
    assert engine.lora is not None
    twin_adapter = engine.lora.load("bad", twin)
    engine.lora.install(twin_adapter if value is None else poisoned(twin_adapter, value))
    return engine


def _run(engine: Engine, static: bool = False) -> tuple[dict[str, list[torch.Tensor]],
                                                        dict[str, list[int]]]:
    """Per request, its logits at every step and its tokens. The adapters take their slots
    first, in order (clean in slot 0, bad in slot 1), then the base model's row joins."""
    runner = engine.runner
    if static:
        runner.use_static_decode()
    rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in PROMPTS}
    execute = runner.execute

    def recording(sched: Any, *args: Any, **kw: Any) -> torch.Tensor:
        out = execute(sched, *args, **kw)
        for request, logits in zip(sched.sampling, out, strict=True):
            rows[request.request_id].append(logits.clone())
        return out

    runner.execute = recording  # type: ignore[method-assign]
    assert engine.lora is not None
    engine.lora.attach("pin-clean", "clean")
    engine.lora.attach("pin-bad", "bad")
    engine.lora.detach("pin-clean")
    engine.lora.detach("pin-bad")
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params, lora_name=None if rid == "base" else rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            tokens[out.request_id] += out.new_token_ids
    lora = engine.lora
    assert [lora.slots.slot_of(slot_key(lora.adapter(n))) for n in ("clean", "bad")] == [0, 1]
    return rows, tokens


def _assert_isolated(got: tuple[dict[str, list[torch.Tensor]], dict[str, list[int]]],
                     want: tuple[dict[str, list[torch.Tensor]], dict[str, list[int]]]
                     ) -> None:
    """The base model's and the clean adapter's logits bit for bit, and their tokens."""
    for rid in ("base", "clean"):
        assert got[1][rid] == want[1][rid], rid
        assert len(got[0][rid]) == len(want[0][rid]) == STEPS
        for step, (g, w) in enumerate(zip(got[0][rid], want[0][rid], strict=True)):
            assert torch.equal(g, w), f"{rid}, step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["lean", "modules", "groups"])
def test_a_bad_adapter_changes_no_other_row(adapters: Any, value: float, path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "groups":
        monkeypatch.setattr(metadata, "WIDE_MAX_TOKENS", 0)
    lean = path == "lean"
    want = _run(_engine(adapters, None, lean))
    got = _run(_engine(adapters, value, lean))
    _assert_isolated(got, want)
    assert got[1]["bad"] != want[1]["bad"] or not all(
        torch.equal(g, w) for g, w in zip(got[0]["bad"], want[0]["bad"], strict=True))


def test_a_bad_adapter_changes_no_other_row_on_the_static_path(adapters: Any) -> None:
    """The decode graphs' path: a static slot buffer, the Triton kernels (interpreted)."""
    want = _run(_engine(adapters, None, False), static=True)
    got = _run(_engine(adapters, float("nan"), False), static=True)
    _assert_isolated(got, want)


def test_the_bad_adapter_is_refused_at_load(adapters: Any, tmp_path: Path) -> None:
    """The same weights in files: the load check refuses them, naming the tensor."""
    from safetensors.torch import save_file

    from worker.engine.lora.adapter import LoraError, load_adapter

    base, _, twin = adapters
    bad = poisoned(load_adapter("bad", twin, base, 16), float("nan"))
    root = tmp_path / "bad"
    root.mkdir()
    (root / "adapter_config.json").write_text(Path(twin, "adapter_config.json").read_text())
    save_file({f"base_model.model.{m}.lora_{ab}.weight": t
               for m, pair in bad.weights.items() for ab, t in zip("AB", pair, strict=True)},
              str(root / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="not finite") as info:
        load_adapter("bad", root, base, 16)
    assert str(tmp_path) not in str(info.value)


def _sequential(engine: Engine) -> dict[str, list[int]]:
    """The bad adapter's request runs alone and finishes; then two base-model requests
    run on its freed blocks (a pool of four: every block is reused)."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    engine.add_request("bad", list(range(100, 120)), params, lora_name="bad")
    while engine.has_unfinished_requests():
        TextOutputs.of(engine).step()
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    engine.add_request("short", PROMPTS["base"], params)
    engine.add_request("long", [7] * 40, params)
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_bad_adapters_freed_blocks_reach_no_later_request(adapters: Any, backend: str
                                                            ) -> None:
    """The bad adapter's rows write NaN keys and values into their KV blocks; requests
    that later take those blocks (their tails past each row's length still hold the
    leftovers) get the tokens they get after its clean twin, on each CPU attention
    backend (the C++ kernel; the torch fallback's masked SDPA)."""
    def run(value: float | None) -> dict[str, list[int]]:
        _, clean, twin = adapters
        engine = Engine(EngineConfig.create(
            default_model_path(), device="cpu", block_size=16, num_blocks=4,
            attention_backend=backend, max_loras=2, max_lora_rank=16,
            lora_modules=[f"clean={clean}"]))
        assert engine.lora is not None
        twin_adapter = engine.lora.load("bad", twin)
        engine.lora.install(twin_adapter if value is None else poisoned(twin_adapter, value))
        return _sequential(engine)

    assert run(float("nan")) == run(None)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("impl", ["sdpa", "reference", "reference-softcap", "cpu-kernel",
                                  "triton"])
def test_decode_attention_never_reads_leftovers(impl: str) -> None:
    """Every decode attention path, with NaN in every cache position no row may see (the
    tails of rows' last blocks, a block no row holds that padded tables point at): each
    row's output bit for bit what it is with finite leftovers."""
    from kernels import cpu_attention, cpu_decode_attention, reference
    from kernels.decode_attention import paged_decode_attention as triton_decode

    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(6, 16, 2, 32, generator=gen) for _ in range(2))
    tables = torch.tensor([[0, 5, 5], [1, 2, 5], [3, 4, 5]], dtype=torch.int32)  # 5: freed
    lens = torch.tensor([5, 19, 33], dtype=torch.int32)
    q = torch.randn(3, 4, 32, generator=gen)

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if impl == "sdpa":
            return cpu_attention.paged_decode_sdpa(q, k, v, tables, lens, 0.2, 33)
        if impl.startswith("reference"):
            cap = 30.0 if impl.endswith("softcap") else None
            return reference.paged_decode_attention(q, k, v, tables, lens, 0.2,
                                                    logits_soft_cap=cap)
        if impl == "cpu-kernel":
            return cpu_decode_attention.paged_decode_attention(q, k, v, tables, lens, 0.2)
        return triton_decode(q, k, v, tables, lens, 0.2)

    want = attend(k_cache, v_cache)
    seen = torch.zeros(6, 16, dtype=torch.bool)
    for row, length in zip(tables.tolist(), lens.tolist(), strict=True):
        for pos in range(length):
            seen[row[pos // 16], pos % 16] = True
    k_cache[~seen], v_cache[~seen] = float("nan"), float("nan")
    assert torch.equal(attend(k_cache, v_cache), want)


def test_sampled_rows_beside_a_bad_adapter(adapters: Any) -> None:
    """Seeded sampling with top-k, top-p, penalties and logprobs: the bad adapter's NaN
    logits stay in its own row of the sampler (its request finishes too), every other
    row's tokens and logprobs are those it gets beside the clean twin."""
    def run(value: float | None) -> dict[str, list[Any]]:
        engine = _engine(adapters, value, True)
        got: dict[str, list[Any]] = {}
        for rid in PROMPTS:
            params = SamplingParams(temperature=0.9, top_p=0.8, top_k=40, seed=5, logprobs=3,
                                    max_tokens=STEPS, ignore_eos=True, presence_penalty=0.5,
                                    repetition_penalty=1.2)
            engine.add_request(rid, PROMPTS["base"], params,
                               lora_name=None if rid == "base" else rid)
            got[rid] = []
        while engine.has_unfinished_requests():
            for out in TextOutputs.of(engine).step():
                got[out.request_id].append((out.new_token_ids, out.logprobs))
        return got

    want, got = run(None), run(float("nan"))
    assert got["base"] == want["base"] and got["clean"] == want["clean"]
    assert len(got["bad"]) == STEPS
