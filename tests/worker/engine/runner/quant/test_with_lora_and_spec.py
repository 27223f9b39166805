"""Quantized weights under the engine's other techniques. A LoRA adapter over int8/int4
base layers (the wrapper calls the quantized module, then adds the adapter's product)
agrees with the same adapter over the dequantized float weights under vLLM's top-5 rule;
speculative (suffix) decoding over quantized weights gives the tokens of plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.lora_adapters import write_adapter
from tests.worker.engine.runner.quant.agreement import (
    GREEDY,
    PROMPTS,
    assert_top5_agreement,
)
from tests.worker.engine.runner.quant.quantizers import write_quantized


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant-techniques")


@pytest.mark.parametrize("fmt", ["ct-int8", "awq"])
def test_a_lora_adapter_over_quantized_weights(root: Path, fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    from worker.engine.llm import LLM
    from worker.engine.lora.targets import base_targets

    src = build_checkpoint("llama", root)
    quantized, reference = write_quantized(src, fmt, root)
    base = base_targets(AutoModelForCausalLM.from_pretrained(src), src)
    adapter = write_adapter(root / f"adapter-{fmt}", base, rank=8, alpha=16, std=0.15)
    outs = []
    for path in (quantized, reference):
        llm = LLM(path, kv_cache_blocks=64, lora_modules=[f"sql={adapter}"])
        outs.append([o.choices[0] for o in llm.generate(PROMPTS, GREEDY, lora_name="sql")])
    assert_top5_agreement(*outs)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_speculative_decoding_over_quantized_weights_changes_no_token(root: Path,
                                                                      method: str) -> None:
    from worker.engine.llm import LLM

    src = build_checkpoint("llama", root)
    repeat = [list(range(20, 28)) * 4, list(range(40, 45)) * 5]  # drafts from their own text
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for spec in ({}, {"speculative": "suffix", "num_speculative_tokens": 5,
                      "min_match_tokens": 1, "draft_token_cost": 1e-3,
                      "draft_step_cost": 0.0}):
        llm = LLM(src, kv_cache_blocks=64, quantization=method, **spec)
        outs.append([o.choices[0].token_ids for o in llm.generate(repeat, params)])
    assert outs[0] == outs[1]
