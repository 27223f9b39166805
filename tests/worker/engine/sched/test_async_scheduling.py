"""Overlapped steps (``async_scheduling``) with a real model forward: nothing changes but
the timing.

The same workloads run with steps read back at once and with step N+1 launched before
step N is read back; every request's tokens, text, finish reason and logprobs must be
equal. The workloads cover what overlap makes delicate: requests that end while their
next step is already launched (EOS, a stop token, a stop string, max_tokens, a cancel),
preemption in a small pool, the prefix cache, seeded sampling, n > 1, rows whose sampling
reads earlier tokens (penalties, a grammar: the previous step is read back first), the
static decode path (CUDA graphs' buffers, uncaptured on a CPU) and a failing forward.
"""

from __future__ import annotations

from typing import Any

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

Finals = dict[str, tuple[Any, ...]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("async"))


def _engine(path: str, overlap: bool, num_blocks: int = 200, **kw: Any) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=num_blocks, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
        long_prefill_token_threshold=24, device="cpu", async_scheduling=overlap, **kw,
    ))


def _prompt(i: int, vocab: int, length: int) -> list[int]:
    shared = [(7 * k) % (vocab - 3) + 3 for k in range(40)]  # a prefix most requests share
    tail = [(31 * i + 11 * k) % (vocab - 3) + 3 for k in range(length)]
    return (shared if i % 2 else []) + tail


def _jobs(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.8, seed=5, n=3, ignore_eos=True),
        # a negative penalty makes the last token win: it must be known when sampling
        SamplingParams(max_tokens=10, temperature=0, frequency_penalty=-2.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0),
        SamplingParams(max_tokens=7, temperature=0.7, seed=9, top_k=20, top_p=0.9,
                       min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=1,
                       structured_output={"regex": "[a-c]{3,5}-[0-9]{2}"}),
    ]


def _run(engine: Engine, jobs: list[SamplingParams], cancel: str | None = None) -> Finals:
    vocab = engine.runner.shape.vocab_size
    tokens: dict[tuple[str, int], list[int]] = {}
    finals: Finals = {}

    def take(outputs: list[Any]) -> None:
        _collect(outputs)
        # cancelled once the caller has seen 3 of its tokens (a 4th may be in flight)
        if cancel is not None and len(tokens.get((cancel, 0), [])) >= 3 \
                and f"{cancel}/0" not in finals:
            _collect(TextOutputs.of(engine).abort(cancel))

    def _collect(outputs: list[Any]) -> None:
        for out in outputs:
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finals[f"{out.request_id}/{out.index}"] = (
                    tokens[key], out.finish_reason, out.num_output_tokens, out.error)

    for i, params in enumerate(jobs * 2):
        engine.add_request(f"r{i}", _prompt(i, vocab, 5 + 3 * i), params, priority=i % 3 - 1)
        if i % 3 == 2:  # arrivals while others run
            take(TextOutputs.of(engine).step())
    while engine.has_unfinished_requests():
        take(TextOutputs.of(engine).step())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()
    return finals


def _stop_token(path: str) -> int:
    """A token the greedy request r2 produces mid-way, so its stop token really ends it."""
    engine = _engine(path, overlap=False)
    vocab = engine.runner.shape.vocab_size
    engine.add_request("probe", _prompt(2, vocab, 11), SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in TextOutputs.of(engine).step():
            out += o.new_token_ids
    return out[6]


@pytest.mark.parametrize("num_blocks", [200, 26])  # roomy; small enough to preempt
def test_overlapped_steps_change_no_output(checkpoint: str, num_blocks: int) -> None:
    jobs = _jobs(_stop_token(checkpoint))
    sync, overlapped = _engine(checkpoint, False, num_blocks), _engine(checkpoint, True,
                                                                      num_blocks)
    assert not sync.overlap and overlapped.overlap
    expected = _run(sync, jobs, cancel="r6")
    assert _run(overlapped, jobs, cancel="r6") == expected
    assert expected["r2/0"][1] == "stop" and len(expected["r2/0"][0]) < 20
    assert expected["r6/0"][1] == "abort"
    assert expected["r8/0"][1] == "stop" and expected["r8/0"][3] is None  # the grammar's end
    if num_blocks == 26:
        assert overlapped.stats().num_preemptions > 0


def test_static_decode_path_reads_pending_tokens_on_the_device(checkpoint: str) -> None:
    jobs = _jobs(_stop_token(checkpoint))
    expected = _run(_engine(checkpoint, False), jobs)
    static = _engine(checkpoint, True)
    static.runner.use_static_decode()
    assert _run(static, jobs) == expected


def test_stop_strings_end_the_same_step(checkpoint: str) -> None:
    probe = _engine(checkpoint, False)
    vocab = probe.runner.shape.vocab_size
    probe.add_request("p", _prompt(4, vocab, 8), SamplingParams(max_tokens=24, temperature=0,
                                                                ignore_eos=True))
    text = ""
    while probe.has_unfinished_requests():
        text += "".join(o.text for o in TextOutputs.of(probe).step())
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    results = []
    for overlap in (False, True):
        engine = _engine(checkpoint, overlap)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        engine.add_request("s", _prompt(4, vocab, 8), params)
        engine.add_request("busy", _prompt(5, vocab, 8), SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))
        texts: dict[str, str] = {}
        reasons: dict[str, str | None] = {}
        while engine.has_unfinished_requests():
            for o in TextOutputs.of(engine).step():
                texts[o.request_id] = texts.get(o.request_id, "") + o.text
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
        results.append((texts, reasons))
    assert results[0] == results[1]
    assert results[1][1]["s"] == "stop" and stop not in results[1][0]["s"]


def test_a_failing_forward_fails_its_batch_and_the_step_before_is_delivered(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(checkpoint, True)
    vocab = engine.runner.shape.vocab_size
    for i in range(3):
        engine.add_request(f"f{i}", _prompt(i, vocab, 6), SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    for _ in range(4):
        for o in TextOutputs.of(engine).step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    before = {rid: len(t) for rid, t in got.items()}
    real = engine.runner.execute

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = TextOutputs.of(engine).step()
    # the step launched before the failure is read back first: one more token each
    assert [o.finished for o in outputs] == [False] * 3 + [True] * 3
    assert all(len(o.new_token_ids) == 1 for o in outputs[:3])
    assert {o.error for o in outputs[3:]} == {"RuntimeError: device lost"}
    assert all(o.num_output_tokens == before[o.request_id] + 1 for o in outputs[3:])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    monkeypatch.setattr(engine.runner, "execute", real)
    engine.add_request("after", _prompt(9, vocab, 6), SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        TextOutputs.of(engine).step()


def test_default_is_overlap_on_cuda_only(checkpoint: str) -> None:
    assert not Engine(EngineConfig.create(checkpoint, device="cpu", num_blocks=32)).overlap
    env = EngineConfig.from_env(checkpoint, {"FERRY_ASYNC_SCHEDULING": "1"})
    assert env.scheduler.async_scheduling is True
    assert EngineConfig.from_env(checkpoint, {}).scheduler.async_scheduling is None
