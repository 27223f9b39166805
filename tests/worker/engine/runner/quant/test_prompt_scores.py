"""Prompt logprobs (what the bits-per-byte benchmark scores with) come from the quantized
model's own logits: they equal transformers' forward of the same quantized layers, and
differ from the float model's by far more than that.

Why a test: on the default model fp32, bf16 and fp8 scored held-out text to the same four
decimals; that is the quantization being gentle (its bf16-trained weights; errors of both
signs averaging out over 40 kB), not a scoring path that reads float logits, and this
holds the scoring path to it on a tiny model where the methods' logprobs differ by tenths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.worker.engine.runner.quant.agreement import checkpoint, fp8_reference_forward
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

PROMPT = list(range(3, 60, 2)) + list(range(7, 40, 3))  # 40 tokens: a prefill of >32 rows
# the engine's logprobs against transformers running the same quantized modules (fp8: its
# fp32 reference of the same rounding): measured 2e-6 (int8), 3e-6 (int4), 4e-5 (fp8), where
# each differs from the float model's by 0.23, 4.4 and 0.75
TOL = 1e-3


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> str:
    return checkpoint("llama", Path(tmp_path_factory.mktemp("quant-scores")))


def _engine_scores(path: str, **options: Any) -> torch.Tensor:
    """[len(PROMPT) - 1]: each prompt token's logprob, through the engine."""
    engine = Engine(EngineConfig.create(path, device="cpu", num_blocks=64, **options))
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=1, temperature=0,
                                                   prompt_logprobs=0))
    entries: list[Any] = []
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            entries = out.prompt_logprobs or entries
    assert [e[0] for e in entries] == PROMPT
    return torch.tensor([e[1] for e in entries[1:]], dtype=torch.float64)


def _reference_scores(path: str, method: str) -> torch.Tensor:
    """The same quantized layers (``quant.apply`` on transformers' fp32 model), its forward."""
    from transformers import AutoModelForCausalLM

    from worker.engine.runner import quant

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quant.apply(model, quant.prepare(method, model.config, path), path)  # type: ignore[arg-type]
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)  # [T, V]
    return logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_prompt_logprobs_are_the_quantized_models_own(
        src: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _engine_scores(src, quantization=method)
    if method == "fp8":  # the kernel's rounding, in fp32 torch (agreement.py)
        from worker.engine.runner.quant.fp8 import Fp8Linear

        monkeypatch.setattr(Fp8Linear, "forward", fp8_reference_forward)
    own = (got - _reference_scores(src, method)).abs().max().item()
    against_float = (got - _engine_scores(src)).abs().max().item()
    assert own < TOL, (method, own)
    assert against_float > 50 * TOL, (method, against_float)
