"""CPU linear layers on packed oneDNN weights: same results as nn.Linear, bounded shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.packed_linear import PackedLinear, bucket_rows, pack_linears
from worker.engine.text_output import TextOutputs


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 127, 129, 513, 1100])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_linear_for_any_row_count(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 40, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == want.shape == (1, rows, 40)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_row_buckets_are_few_and_never_smaller():
    sizes = {bucket_rows(r) for r in range(1, 4097)}
    assert all(bucket_rows(r) >= r for r in range(1, 4097))
    assert all(bucket_rows(r) - r < 8 for r in range(1, 129))  # decode batches: < 8 padded
    assert len(sizes) <= 64


def test_pack_linears_packs_a_small_tied_lm_head_only(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from worker.engine import packed_linear

    path = build_checkpoint("qwen2", tmp_path)  # tied embeddings
    model = AutoModelForCausalLM.from_pretrained(path)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    embedding = model.get_input_embeddings().weight
    monkeypatch.setattr(packed_linear, "_TIED_PACK_BYTES", 0)  # every head "large"
    assert pack_linears(model) == linears - 1
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is embedding

    model = AutoModelForCausalLM.from_pretrained(path)
    embedding = model.get_input_embeddings().weight
    monkeypatch.undo()
    assert pack_linears(model) == linears
    assert type(model.lm_head) is PackedLinear  # its few-row path reads the embedding
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()
    x = torch.randn(5, embedding.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(x), x @ embedding.T, atol=1e-5, rtol=1e-5)


def test_engine_tokens_do_not_depend_on_packing(tmp_path):
    path = build_checkpoint("llama", tmp_path)

    def run(pack: bool) -> list[list[int]]:
        engine = Engine(EngineConfig.create(path, device="cpu", num_blocks=64,
                                            pack_weights=pack))
        kinds = {type(m).__name__ for m in engine.runner.model.modules()}
        assert ("PackedLinear" in kinds) == pack

        outs: dict[str, list[int]] = {}
        for i, prompt in enumerate([[5, 6, 7], list(range(3, 40)), [9]]):
            engine.add_request(str(i), prompt, {"temperature": 0, "max_tokens": 8,
                                                "ignore_eos": True})
        while engine.has_unfinished_requests():
            for out in TextOutputs.of(engine).step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [outs[str(i)] for i in range(3)]

    assert run(True) == run(False)
