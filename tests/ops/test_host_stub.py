"""The host-step benchmark's stub really stands in for the model on every path a step can
take (``ops/bench/engine/host_stub.py``): a path that ran the real layers instead (the lean CPU
decode did, once) would time a 6-layer forward as "host work"."""

from __future__ import annotations

import pytest

from ops.bench.engine.host_step import Feeder, make_engine
from ops.bench.engine.host_stub import STUB_VOCAB, DeviceClock


@pytest.mark.parametrize("workload", ["greedy", "sampled"])
def test_every_step_is_the_stubs(workload: str) -> None:
    engine = make_engine(8)
    feeder = Feeder(engine, workload, 8)
    calls = {"stub": 0}
    stub_forward = engine.runner.model.forward

    def counted(*args: object, **kwargs: object) -> object:
        calls["stub"] += 1
        return stub_forward(*args, **kwargs)

    engine.runner.model.forward = counted
    tokens: list[int] = []
    for _ in range(12):  # the prompts' prefill, then pure decode steps
        batch = engine.step()
        tokens += batch.token_ids
        for _ in range(len(batch.ends)):
            feeder.add()
    assert calls["stub"] == engine.steps  # every forward was the stub's
    assert tokens and max(tokens) < STUB_VOCAB  # its logits span only the first ids
    assert isinstance(feeder.clock, DeviceClock) and feeder.clock.seconds > 0
