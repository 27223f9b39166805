"""The engine runs LoRA adapters by name: each request names its adapter, the scheduler
pins the adapter's slot while the request runs (waiting when every slot is held),
preemption and aborts give slots back, the prefix cache never mixes adapters, and an
adapter unloaded mid-flight still serves the requests it had accepted.

References are transformers' ``generate`` on each adapter merged into the weights
(``test_lora_exact.py``'s helpers), fp32 on CPU.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.lora.test_lora_exact import _load, _merged
from tests.worker.engine.lora_adapters import ATTN, write_adapter
from tests.worker.engine.test_correctness import assert_matches, reference_greedy
from worker import Engine, EngineConfig
from worker.engine.lora.adapter import LoraError
from worker.engine.lora.engine_hooks import UnknownAdapter
from worker.engine.lora.targets import base_targets
from worker.engine.output.text_output import TextOutputs

SPECS = {"all8": (8, 16, None), "attn16": (16, 8, ATTN), "mlp4": (4, 4, ("gate_proj",))}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, tuple[str, float]]]:
    root = tmp_path_factory.mktemp("lora-engine")
    path = build_checkpoint("llama", root)
    base = base_targets(_load(path), path)
    adapters = {}
    for seed, (name, (rank, alpha, targets)) in enumerate(SPECS.items(), start=11):
        kwargs: dict[str, Any] = {"targets": targets} if targets else {}
        adapters[name] = (write_adapter(root / name, base, rank=rank, alpha=alpha, seed=seed,
                                        std=0.15, **kwargs), alpha / rank)
    return path, adapters


def _engine(path: str, adapters: dict[str, tuple[str, float]], **kw: Any) -> Engine:
    opts: dict[str, Any] = dict(num_blocks=64, block_size=8, max_num_seqs=8,
                                max_num_batched_tokens=48, long_prefill_token_threshold=24,
                                attention_backend="cpu")
    opts.update(kw)
    return Engine(EngineConfig.create(
        path, device="cpu", max_loras=2, max_lora_rank=16,
        max_cpu_loras=4, lora_modules=[f"{n}={p}" for n, (p, _) in adapters.items()],
        **opts))


def _run(engine: Engine, jobs: list[tuple[str, str | None, list[int]]],
         max_tokens: int = 10) -> dict[str, list[int]]:
    for rid, name, prompt in jobs:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True), lora_name=name)
    results: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            results[out.request_id] += out.new_token_ids
        engine.scheduler.check_invariants()
        running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 2, f"{running} run at once on two slots"
        _seen.append(running)
    return results


_seen: list[set[str]] = []  # the adapters running after each step (all tests)


def _check(path: str, adapters: dict[str, tuple[str, float]], results: dict[str, list[int]],
           jobs: list[tuple[str, str | None, list[int]]], max_tokens: int = 10) -> None:
    for name in [*adapters, None]:
        model = _merged(path, adapters[name] if name else None)
        for rid, job_name, prompt in jobs:
            if job_name == name:
                want, gaps = reference_greedy(model, prompt, max_tokens)
                assert_matches(results[rid], want, gaps, f"{rid} ({name})")


def _jobs(vocab: int, names: list[str | None], seed: int = 3) -> list[tuple[str, str | None,
                                                                        list[int]]]:
    rng = random.Random(seed)
    return [(f"q{i}", name, [rng.randrange(vocab) for _ in range(rng.choice([3, 17, 40]))])
            for i, name in enumerate(names)]


def test_three_adapters_and_the_base_model_over_two_slots(setup) -> None:
    """Three adapters share two device slots: requests of the third wait for a slot, and
    every output equals its merged model's."""
    path, adapters = setup
    engine = _engine(path, adapters)
    jobs = _jobs(engine.runner.shape.vocab_size, [*adapters, None] * 2)
    _seen.clear()
    results = _run(engine, jobs)
    _check(path, adapters, results, jobs)
    assert engine.lora is not None and engine.lora.slots.pins == [0, 0]
    assert set().union(*_seen) == set(adapters)  # the third adapter waited, then ran


def test_preemption_gives_the_slot_back_and_outputs_stay_exact(setup) -> None:
    path, adapters = setup
    engine = _engine(path, adapters, num_blocks=14)  # 112 tokens for ~8 x 30: preemption
    jobs = _jobs(engine.runner.shape.vocab_size, ["all8", "attn16", None, "mlp4"] * 2, seed=5)
    results = _run(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    _check(path, adapters, results, jobs)
    assert engine.lora is not None and engine.lora.slots.pins == [0, 0]


def test_aborts_give_slots_back(setup) -> None:
    path, adapters = setup
    engine = _engine(path, adapters)
    for i, name in enumerate(["all8", "attn16", "mlp4"]):
        engine.add_request(f"a{i}", [5, 6, 7, 8], SamplingParams(max_tokens=50),
                           lora_name=name)
    TextOutputs.of(engine).step()
    for i in range(3):
        engine.abort(f"a{i}")
    assert engine.lora is not None and engine.lora.slots.pins == [0, 0]
    assert not engine.has_unfinished_requests()


def test_the_prefix_cache_never_mixes_adapters(setup) -> None:
    """The same 40-token prompt on adapter A, the base model, adapter B, then A again:
    only the repeat of A (same adapter, same registration) hits the cache."""
    path, adapters = setup
    engine = _engine(path, adapters)
    prompt = list(range(3, 43))
    stats = engine.block_manager.stats
    hits = []
    for i, name in enumerate(["all8", None, "attn16", "all8"]):
        before = stats.hits
        _run(engine, [(f"p{i}", name, prompt)], max_tokens=2)
        hits.append(stats.hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 32


def test_unknown_adapter_and_lora_off_are_clear_errors(setup) -> None:
    path, adapters = setup
    engine = _engine(path, adapters)
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded.*all8"):
        engine.add_request("x", [1, 2, 3], lora_name="nope")
    plain = Engine(EngineConfig.create(path, device="cpu", num_blocks=16, block_size=8))
    assert plain.lora is None
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request("x", [1, 2, 3], lora_name="all8")
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()


def test_unloaded_while_running_finishes_and_new_requests_are_refused(setup) -> None:
    path, adapters = setup
    engine = _engine(path, adapters)
    assert engine.lora is not None
    jobs = _jobs(engine.runner.shape.vocab_size, ["all8", "all8", None], seed=9)
    results = _start(engine, jobs)
    engine.lora.remove_adapter("all8")
    with pytest.raises(UnknownAdapter):
        engine.add_request("late", [1, 2, 3], lora_name="all8")
    _finish(engine, results)
    _check(path, adapters, results, jobs)
    assert engine.lora.slots.pins == [0, 0] and "all8" not in engine.lora.adapters()
    assert not any(n and n.startswith("all8|") for n in engine.lora.slots.names)  # freed


def test_a_name_registered_again_serves_new_requests_at_once(setup) -> None:
    """``all8`` registered again with other weights (``attn16``'s files) while two rows run
    on it: those finish on the old weights, a request added right after runs on the new
    ones (no wait for the old rows), each version in a slot of its own; the old version's
    slot is freed with its last row."""
    path, adapters = setup
    engine = _engine(path, adapters)
    assert engine.lora is not None
    jobs = _jobs(engine.runner.shape.vocab_size, ["all8", "all8", None], seed=9)
    results = _start(engine, jobs)
    old_key = engine.lora.cache.keys["all8"]
    engine.lora.remove_adapter("all8")
    engine.lora.add_adapter("all8", adapters["attn16"][0])  # at once, rows still running
    new_key = engine.lora.cache.keys["all8"]
    prompt = jobs[0][2]
    engine.add_request("renewed", prompt, SamplingParams(temperature=0, max_tokens=10,
                                                         ignore_eos=True), lora_name="all8")
    results["renewed"] = []
    _finish(engine, results)
    _check(path, adapters, results, jobs)  # the old rows: the old weights
    want, gaps = reference_greedy(_merged(path, adapters["attn16"]), prompt, 10)
    assert_matches(results["renewed"], want, gaps, "renewed (all8 registered again)")
    assert results["renewed"] != results[jobs[0][0]]  # the weights did change
    assert engine.lora.slots.pins == [0, 0]
    assert engine.lora.slots.slot_of(old_key) is None and old_key != new_key


def _start(engine: Engine, jobs: list[tuple[str, str | None, list[int]]]
           ) -> dict[str, list[int]]:
    """Add ``jobs`` and run one step (each is admitted: its adapter's slot is pinned)."""
    for rid, name, prompt in jobs:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True), lora_name=name)
    results: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    for out in TextOutputs.of(engine).step():
        results[out.request_id] += out.new_token_ids
    return results


def _finish(engine: Engine, results: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            results[out.request_id] += out.new_token_ids
        engine.scheduler.check_invariants()


def test_bad_module_spec_and_bad_adapter_at_start(setup, tmp_path: Path) -> None:
    path, adapters = setup
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig.create(path, lora_modules="all8")
    with pytest.raises(LoraError, match="adapter files are missing or unreadable"):
        _engine(path, {"ghost": (str(tmp_path / "missing"), 1.0)})


def test_settings_from_the_environment() -> None:
    cfg = EngineConfig.from_env("m", env={"FERRY_MAX_LORAS": "3", "FERRY_MAX_LORA_RANK": "32",
                                          "FERRY_LORA_MODULES": "a=/x, b=/y"})
    assert cfg.lora is not None and (cfg.lora.max_loras, cfg.lora.max_lora_rank) == (3, 32)
    assert cfg.lora_modules == (("a", "/x"), ("b", "/y"))
    assert EngineConfig.from_env("m", env={}).lora is None
    assert EngineConfig.from_env("m", env={"FERRY_ENABLE_LORA": "1"}).lora is not None


def test_the_static_decode_path_runs_the_adapters_too(setup) -> None:
    """The decode graphs' path (uncaptured on a CPU, the Triton LoRA kernels under the
    interpreter) gives the eager path's tokens: adapters ride the graphs through a static
    slot buffer, sorted on the device, with no recapture when adapters change."""
    path, adapters = setup
    eager = _engine(path, adapters, attention_backend="torch")
    jobs = _jobs(eager.runner.shape.vocab_size, ["all8", None, "attn16", "mlp4"] * 2, seed=13)
    want = _run(eager, jobs)
    static = _engine(path, adapters, attention_backend="torch")
    static.runner.use_static_decode()
    graphs = static.runner.graphs
    assert graphs is not None and graphs.lora is static.lora
    calls: list[list[int]] = []
    inner = graphs.run

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(list(kw["lora_slots"]))
        return inner(*args, **kw)

    graphs.run = counted  # type: ignore[method-assign]
    assert _run(static, jobs) == want
    assert calls and any(s >= 0 for row in calls for s in row)  # adapters in static steps
    assert any(-1 in row for row in calls)  # and the base model beside them


def test_n_candidates_and_a_grammar_run_on_the_adapter(setup) -> None:
    """``n = 2``: each candidate runs on the request's adapter (its tokens equal a single
    request with that candidate's parameters); a JSON-schema request on an adapter gives
    valid JSON of the schema."""
    import json

    from worker.engine.choices import candidate_params

    path, adapters = setup
    engine = _engine(path, adapters)
    params = SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=8, ignore_eos=True)
    outs = _collect(engine, {"multi": ([7, 8, 9, 10], params, "attn16")})
    singles = _collect(engine, {f"c{i}": ([7, 8, 9, 10], candidate_params(params, i), "attn16")
                                for i in range(2)})
    assert sorted(outs["multi"]) == sorted([singles["c0"][0], singles["c1"][0]])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    structured = SamplingParams(temperature=0, max_tokens=40,
                                structured_output={"json_schema": schema})
    text = _collect(engine, {"js": ("Answer:", structured, "all8")}, text=True)["js"][0]
    assert set(json.loads(text)) == {"ok"}
    assert engine.lora is not None and engine.lora.slots.pins == [0, 0]


def _collect(engine: Engine, jobs: dict[str, tuple[Any, SamplingParams, str | None]],
             text: bool = False) -> dict[str, list[Any]]:
    """Per request, each candidate's tokens (or text), in candidate order."""
    for rid, (prompt, params, name) in jobs.items():
        engine.add_request(rid, prompt, params, lora_name=name)
    got: dict[str, dict[int, Any]] = {rid: {} for rid in jobs}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            slot = got[out.request_id].setdefault(out.index, "" if text else [])
            got[out.request_id][out.index] = slot + (out.text if text else out.new_token_ids)
    return {rid: [c[i] for i in sorted(c)] for rid, c in got.items()}


def test_adapter_outputs_stay_out_of_the_draft_store(setup: Any) -> None:
    """With speculation on, a finished base-model request's text goes into the store of
    past outputs; an adapter's does not (the store drafts for base-model rows, and the
    fleet's stream is the base model's)."""
    path, adapters = setup
    engine = _engine(path, adapters, speculative="suffix")
    assert engine.spec is not None
    store = engine.spec.store
    _run(engine, [("lora", "all8", [5, 6, 7, 8, 9, 10])])
    assert store.num_tokens == 0
    _run(engine, [("base", None, [5, 6, 7, 8, 9, 10])])
    assert store.num_tokens > 0
