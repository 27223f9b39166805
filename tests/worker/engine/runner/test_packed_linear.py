"""CPU linear layers on packed oneDNN weights: same results as nn.Linear, bounded shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.cpu.packed_linear import PackedLinear, bucket_rows, pack_linears


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

    from worker.engine.runner.cpu import packed_linear

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
    """Packed or not, and whatever rows the packed weights leave to ``F.linear``."""
    path = build_checkpoint("llama", tmp_path)

    def run(pack: bool, gemv_rows: int | None = None) -> list[list[int]]:
        engine = Engine(EngineConfig.create(path, device="cpu", num_blocks=64,
                                            pack_weights=pack, packed_gemv_rows=gemv_rows))
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

    plain = run(False)
    assert run(True) == plain
    assert run(True, 0) == run(True, 32) == plain


def test_gemv_rows_fixed_or_measured_per_weight_size():
    from worker.engine.runner.cpu import gemv_calibration
    from worker.engine.runner.cpu.packed_linear import _CACHED_BYTES

    torch.manual_seed(0)
    small = [PackedLinear(nn.Linear(64, 64)) for _ in range(3)]
    large = [PackedLinear(nn.Linear(512, _CACHED_BYTES // (4 * 512) + 8))]
    assert gemv_calibration.set_gemv_rows(small + large, fixed=5) == {"small": 5, "large": 5}
    assert {m.gemv_rows for m in small + large} == {5}

    chosen = gemv_calibration.set_gemv_rows(small + large)
    assert set(chosen) == {"small", "large"}
    for name, group in (("small", small), ("large", large)):
        assert chosen[name] in (0, *gemv_calibration.ROWS)
        assert {m.gemv_rows for m in group} == {chosen[name]}
    # one measurement per set of shapes: a second engine of the model reuses it
    key = (tuple((m.out_features, m.in_features) for m in small), torch.get_num_threads(), 0,
           torch.float32)
    assert gemv_calibration._measured[key] == chosen["small"]
    # timed on one thread up to serial_rows, as the runner runs such steps; the threads
    # configured are back afterwards
    threads = torch.get_num_threads()
    assert gemv_calibration.measured_gemv_rows(small, serial_rows=32) in (
        0, *gemv_calibration.ROWS)
    assert torch.get_num_threads() == threads


def test_gemv_rows_measured_for_bf16_weights():
    """The calibration times a bf16 weight on bf16 rows (fp32 rows made the packed op
    fail, and with it the load of every bf16 model on the CPU)."""
    from worker.engine.runner.cpu import gemv_calibration
    from worker.engine.runner.cpu.packed_linear import packing_works

    if not packing_works(torch.bfloat16):
        pytest.skip("no packed bf16 linear in this torch build")
    torch.manual_seed(0)
    group = [PackedLinear(nn.Linear(64, 96, bias=False).to(torch.bfloat16)) for _ in range(2)]
    assert gemv_calibration.measured_gemv_rows(group) in (0, *gemv_calibration.ROWS)


@pytest.mark.parametrize("rows", [0, 1, 32])
def test_packed_path_follows_the_threshold_and_stays_equal(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear)
    packed.gemv_rows = rows
    for n in (1, 2, 5, 33):
        x = torch.randn(n, 48)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_bad_gemv_rows_setting_is_refused(raw):
    with pytest.raises(ValueError, match="PACKED_GEMV_ROWS|packed_gemv_rows"):
        EngineConfig.from_env("some-model", {"FERRY_PACKED_GEMV_ROWS": raw})


def test_gemv_rows_setting_reaches_the_engine(tmp_path):
    path = build_checkpoint("llama", tmp_path)
    cfg = EngineConfig.from_env(path, {"FERRY_PACKED_GEMV_ROWS": "7", "FERRY_DEVICE": "cpu",
                                       "FERRY_KV_CACHE_BLOCKS": "32"})
    engine = Engine(cfg)
    rows = {m.gemv_rows for m in engine.runner.model.modules() if isinstance(m, PackedLinear)}
    assert rows == {7}
