"""The host-step benchmark's stub model: the real engine around a forward that costs nothing.

What a GPU step leaves to the host is everything but the forward: scheduling, building the
inputs, launching sampling, reading tokens back, finishing requests, and (in the output
process) detokenizing and publishing. To time exactly that on a CPU, the model's body is
replaced by ``StubModel``: it writes its hidden states (the input tokens' embeddings, so the
next token depends on the last one and the streams' text varies) and nothing else, and its
logits span only the first ``STUB_VOCAB`` ids of the default model's vocabulary, so the
tensor ops cost the CPU about what their launches cost on a GPU while detokenizing stays
real (the default model's own tokenizer).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

STUB_VOCAB = 512


class StubModel(nn.Module):
    """Stands in for ``runner.model``: same call signature, embeddings as hidden states."""

    def __init__(self, model: Any, vocab: int = STUB_VOCAB) -> None:
        super().__init__()
        self.embed = model.get_input_embeddings()
        weight = model.get_output_embeddings().weight.detach()
        self.head = weight[:vocab].clone()  # [V', H]
        self.base_model = self._body

    def _body(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.embed(input_ids[0])  # [T, H]: the forward's hidden states

    def forward(self, input_ids: torch.Tensor, logits_to_keep: torch.Tensor | None = None,
                **_: Any) -> Any:
        hidden = self._body(input_ids)  # [T, H]
        rows = hidden if logits_to_keep is None else hidden.index_select(0, logits_to_keep)
        return SimpleNamespace(logits=(rows @ self.head.T)[None])  # [1, N, V']


class DeviceClock:
    """Time spent in what a GPU would run as a few launches: the stub's forward and the
    sampler's pass (``_greedy_pass`` / ``_sample_pass``: one Triton kernel on CUDA). On a
    CPU their arithmetic runs inline and is timed with the step; ``host_step.py`` reports
    the step less this clock as the host's own work, next to the whole step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the same spans in this thread's CPU time

    def wrap(self, fn: Any) -> Any:
        """``fn`` timed on this clock (the function itself, if another clock wrapped it)."""
        fn = getattr(fn, "__wrapped__", fn)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def install(self, engine: Any) -> DeviceClock:
        """Time ``engine``'s stub forward and the sampler's passes (module-wide)."""
        from worker.engine.sample import sampler

        engine.runner.model.forward = self.wrap(engine.runner.model.forward)
        for name in ("_greedy_pass", "_sample_pass"):
            setattr(sampler, name, self.wrap(getattr(sampler, name)))
        return self


def stub_engine(engine: Any, vocab: int = STUB_VOCAB) -> Any:
    """Swap ``engine``'s model for the stub; static decode buffers and the lean CPU decode
    are dropped (the stub has neither), so every step goes through ``ModelRunner.execute``'s
    eager path."""
    runner = engine.runner
    runner.model = StubModel(runner.model, vocab)
    runner.graphs = None
    runner.lean = None  # the lean CPU decode runs the real layers: the stub must answer
    return engine
