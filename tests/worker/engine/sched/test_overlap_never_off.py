"""Overlap is never switched off: with penalties, grammars, prompt logprobs and multi-token
bad words in the batch, step N's values are read on the host only after step N+1's
forward is launched, and every output is the one the engine gives without overlap.

On a CPU nothing is asynchronous, so a "device" is emulated: each step's logits come out
of the forward as a tracked tensor whose tag (the step) spreads to every tensor computed
from it (sampled tokens, logprobs, prompt logprobs, penalty counts); a host read of a
tracked tensor (``tolist``, ``item``, ``numpy``, ``int(t)``...) is a wait for that step's
device work, and is logged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.cpu,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__,
          torch.Tensor.__index__}
_log: list[tuple[str, int]] = []


class _OnDevice(torch.Tensor):
    """A tensor "on the device" of step ``step``: host reads of it are logged."""

    step = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        steps = [a.step for a in tree_flatten((args, kwargs))[0] if isinstance(a, _OnDevice)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _READS:
            _log.append(("read", max(steps)))
            return out
        flat = tree_flatten(out)[0]
        if len(flat) == 1 and isinstance(out, torch.Tensor) and steps:
            tracked = out.as_subclass(_OnDevice)
            tracked.step = max(steps)
            return tracked
        return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("never_off"))


def _engine(path: str, overlap: bool) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=200, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
        device="cpu", async_scheduling=overlap))


def _jobs(bad: list[str]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=-2.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=4, repetition_penalty=1.3,
                       presence_penalty=0.5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, seed=1,
                       structured_output={"regex": "[a-c]{3,5}-[0-9]{2}"}),  # type: ignore[arg-type]
        SamplingParams(max_tokens=10, temperature=0, prompt_logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.8, seed=7, prompt_logprobs=0,
                       ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, bad_words=bad, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, seed=2, ignore_eos=True),
    ]


def _run(engine: Engine, jobs: list[SamplingParams]) -> dict[str, Any]:
    vocab = engine.runner.shape.vocab_size
    got: dict[str, Any] = {}
    for i, params in enumerate(jobs):
        prompt = [(13 * i + 7 * k) % (vocab - 3) + 3 for k in range(6 + 5 * i)]
        engine.add_request(f"r{i}", prompt, params)
    for request in engine.scheduler.waiting:  # grammars compiled before the first step, so
        if request.grammar is not None:  # both runs batch alike (float sums: same shapes)
            request.grammar.future.exception()
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            entry = got.setdefault(out.request_id, {"tokens": [], "text": "", "lp": []})
            entry["tokens"] += out.new_token_ids
            entry["text"] += out.text
            entry["lp"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                entry["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                entry["finish"] = out.finish_reason
    return got


def _bad_words(path: str) -> list[str]:
    """Two words of the greedy text: the first one's tokens, banned, change the output."""
    engine = _engine(path, overlap=False)
    out = _run(engine, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    words = out["r0"]["text"].split()
    return words[1:3] if len(words) > 2 else words[:1]


_KINDS = {"penalties": [0, 1, 2], "grammar": [0, 3], "prompt_logprobs": [0, 4, 5],
          "bad_words": [0, 6], "all": list(range(8))}


@pytest.mark.parametrize("kind", list(_KINDS))
def test_overlap_is_never_switched_off(checkpoint: str, kind: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    every = _jobs(_bad_words(checkpoint))
    jobs = [every[i] for i in _KINDS[kind]]
    expected = _run(_engine(checkpoint, overlap=False), jobs)
    engine = _engine(checkpoint, overlap=True)
    execute = engine.runner.execute

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        step = sum(1 for kind, _ in _log if kind == "forward") + 1
        _log.append(("forward", step))
        logits = execute(*args, **kwargs).as_subclass(_OnDevice)
        logits.step = step
        return logits

    monkeypatch.setattr(engine.runner, "execute", forward)
    _log.clear()
    got = _run(engine, jobs)
    assert got == expected  # token for token, text, logprobs and prompt logprobs
    if kind in ("prompt_logprobs", "all"):
        assert any(len(v.get("prompt_logprobs") or []) > 1 for v in got.values())
    forwards = {step: i for i, (what, step) in enumerate(_log) if what == "forward"}
    assert len(forwards) > 8
    early = [(step, i) for i, (what, step) in enumerate(_log)
             if what == "read" and forwards.get(step + 1, -1) > i]
    assert not early, f"step N read back before step N+1's forward: {early[:5]}"
