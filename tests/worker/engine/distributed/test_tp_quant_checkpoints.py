"""Quantized checkpoints under tensor parallelism (gloo, rank 0 here, rank 1 spawned): each
format test_checkpoint_formats.py builds (compressed-tensors FP8 per channel with dynamic
activations and per tensor with static ones, ModelOpt FP8, compressed-tensors INT8, AWQ,
GPTQ) gives one process's greedy tokens and chosen-token logprobs with two ranks, each
rank reading its cut of the packed tensors, with chunked prefill and preemption; FP8 and
INT8 MoE experts stored per expert likewise (float experts beside quantized layers too); a
group that does not fit a row-parallel shard and INT4 experts are refused by name; each
rank's layers and experts hold exactly its slice of one process's, no packed tensor read
whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.engine.distributed.test_tp_features import ENGINE as _ENGINE
from tests.worker.engine.distributed.test_tp_features import _assert_same, _run
from tests.worker.engine.runner.quant.agreement import build_moe, checkpoint
from tests.worker.engine.runner.quant.quantizers import write_quantized
from worker.engine.llm import LLM
from worker.engine.runner.quant.experts import QuantizedExperts, ScaledExperts
from worker.engine.runner.quant.fp8 import Fp8Linear
from worker.engine.runner.quant.int4 import Int4Linear
from worker.engine.runner.quant.int8 import Int8Linear
from worker.engine.runner.quant.tp_shard import ReducedQuant
from worker.engine.runner.tp_ranks import TensorParallelFault

FORMATS: dict[str, Any] = {
    "ct-fp8-channel": Fp8Linear, "ct-fp8-static": Fp8Linear, "modelopt": Fp8Linear,
    "ct-int8": Int8Linear, "awq": Int4Linear, "gptq": Int4Linear}
ENGINE: dict[str, Any] = _ENGINE


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-quant-checkpoints")


@pytest.mark.parametrize(("fmt", "steps"), [(fmt, 32) for fmt in FORMATS] + [
    ("ct-int8", 64), ("awq", 64), ("gptq", 64)])
def test_quantized_checkpoint_tp2_equals_tp1(root: Path, fmt: str, steps: int) -> None:
    """Llama (4 heads, 2 KV heads, hidden 64, MLP 128; groups of 32): every projection cut
    from its packed tensors (k/v 16 rows a rank: two AWQ words; o 32 columns a rank: one
    group). Every format is exact up to fp32 summation order (1e-5; INT8 at 64-token
    steps runs the path that rounds to bf16 above 32 rows, ``tp_shard.ReducedQuant``;
    INT4 at 64-token steps the fp32 GEMM on weights unpacked from the kernel's layout,
    k/v's 16-row shards included). INT4's packed kernel (32-token steps) rounds to bf16
    where the sum of the ranks' fp32 partials is rounded once; a sum on a rounding
    boundary could land on the other neighbour (test_tp_features' at-load INT4), here
    every logprob is bit-equal."""
    path, _ = write_quantized(checkpoint("llama", root), fmt, root)
    options = dict(max_num_batched_tokens=steps, long_prefill_token_threshold=steps * 3 // 4)
    want, _ = _run(path, 1, **options)
    got, llm = _run(path, 2, **options)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, FORMATS[fmt])  # column-parallel
    assert layer.self_attn.k_proj.out_features == 16  # this rank's KV head
    assert isinstance(layer.mlp.down_proj.inner, FORMATS[fmt])  # row-parallel
    assert layer.mlp.down_proj.inner.in_features == 64
    _assert_same(got, want)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_group_across_the_row_cut_is_refused_by_name(root: Path, fmt: str) -> None:
    """Groups of 64: o_proj's 64 input columns are 32 a rank, no group fits one rank."""
    path, _ = write_quantized(checkpoint("llama", root), fmt, root / f"g64-{fmt}", group=64)
    with pytest.raises(TensorParallelFault, match=r"int4 under tensor parallelism: layer "
                       r"model\.layers\.0\.self_attn\.o_proj's group size 64 does not "
                       r"divide its row-parallel shard of 32 input features \(of 64\)"):
        LLM(path, tensor_parallel_size=2, **ENGINE)


def test_float_experts_beside_quantized_layers_tp2_equals_tp1(root: Path) -> None:
    """Mixtral whose experts the checkpoint left float: its quantized attention is cut
    from the packed tensors, its experts by the intermediate size as usual."""
    path, _ = write_quantized(build_moe(root), "awq", root, experts=False)
    want, _ = _run(path, 1)
    got, llm = _run(path, 2)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert isinstance(attn.o_proj.inner, Int4Linear)
    _assert_same(got, want)


@pytest.fixture
def whole(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of every tensor read whole from a checkpoint, by the quantized load
    (``CheckpointTensors.get``) or the float one (``sharded_load._Checkpoint.get``)."""
    import torch

    from worker.engine.distributed import sharded_load
    from worker.engine.runner.quant.formats import CheckpointTensors

    names: list[str] = []
    get, float_get = CheckpointTensors.get, sharded_load._Checkpoint.get

    def recording_get(self: CheckpointTensors, key: str) -> torch.Tensor | None:
        names.append(key)
        return get(self, key)

    def recording_float_get(self: Any, name: str) -> torch.Tensor:
        names.append(name)
        return float_get(self, name)

    monkeypatch.setattr(CheckpointTensors, "get", recording_get)
    monkeypatch.setattr(sharded_load._Checkpoint, "get", recording_float_get)
    return names


def _rank_model(path: str, rank: int) -> tuple[Any, int, frozenset[str]]:
    """Rank ``rank`` of 2's model from the quantized checkpoint at ``path``, built as the
    sharded load builds it but without a process group: (model, quantized layers, the
    checkpoint's quantized owners)."""
    import torch
    from transformers import AutoConfig

    from worker.engine.distributed.sharded_load import load_sharded
    from worker.engine.distributed.tp_config import TPConfig
    from worker.engine.runner.quant import checkpoint_config
    from worker.engine.runner.quant.formats import modelopt_config
    from worker.engine.runner.quant.tp_checkpoint import (
        apply_checkpoint_sharded,
        quantized_owners,
    )

    raw = getattr(AutoConfig.from_pretrained(path), "quantization_config", None)
    scheme = checkpoint_config.scheme_from_checkpoint(
        checkpoint_config.as_dict(raw or modelopt_config(path)))
    tp = TPConfig(size=2, rank=rank)
    owners = quantized_owners(path, tp.size)
    model = load_sharded(path, tp, torch.float32, keep_meta=owners)
    with torch.no_grad():
        count = apply_checkpoint_sharded(model, scheme, tp, path, owners, torch.device("cpu"))
    return model, count, owners


SCALED = [fmt for fmt, layer in FORMATS.items() if layer is not Int4Linear]


@pytest.mark.parametrize("fmt", SCALED)
def test_quantized_moe_experts_tp2_equals_tp1(root: Path, fmt: str) -> None:
    """Mixtral whose experts the checkpoint holds quantized per expert (``w1``/``w3``/``w2``):
    each rank reads its intermediate rows of every gate and up layer and those columns of
    every down layer into the experts one process builds; the experts' all-reduce sums the
    partials (fp32 activations: no rounding between them)."""
    path, _ = write_quantized(build_moe(root), fmt, root)
    want, _ = _run(path, 1)
    got, llm = _run(path, 2)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts.inner
    assert isinstance(experts.ferry_quantized, QuantizedExperts)
    assert isinstance(experts.ferry_quantized.w2, ScaledExperts)
    _assert_same(got, want)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_moe_experts_are_refused_by_name(root: Path, fmt: str) -> None:
    path, _ = write_quantized(build_moe(root), fmt, root)
    with pytest.raises(TensorParallelFault, match=rf"{fmt} int4 MoE experts \(model\.layers"
                       r"\.0\.mlp\.experts\) are not implemented with tensor-parallel size 2"):
        LLM(path, tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("fmt", ["ct-int8", "ct-fp8-static"])
def test_each_rank_reads_only_its_experts_cut(root: Path, fmt: str, whole: list[str]) -> None:
    """Both ranks' experts, built without a process group, hold exactly their slice of one
    process's (gate rows, up rows, down columns; dequantized, bit for bit), and no expert's
    packed weight is read whole."""
    import torch

    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model

    path, _ = write_quantized(build_moe(root), fmt, root)
    one = load_model(ModelConfig(path, pack_weights=False)).model
    want13, want2 = one.model.layers[0].mlp.experts.ferry_quantized.dequantized()
    inter = want2.shape[2]
    whole.clear()  # what one process read above: the ranks' reads from here on
    for rank in range(2):
        model, _, _ = _rank_model(path, rank)
        assert not [k for k in whole if ".experts." in k and k.endswith(
            (".weight", "gate_up_proj", "down_proj"))], whole
        got13, got2 = model.model.layers[0].mlp.experts.inner.ferry_quantized.dequantized()
        s, e = rank * inter // 2, (rank + 1) * inter // 2
        rows = torch.cat([want13[:, s:e], want13[:, inter + s:inter + e]], dim=1)
        torch.testing.assert_close(got13, rows, rtol=0, atol=0)  # [E, 2I/2, H]
        torch.testing.assert_close(got2, want2[:, :, s:e], rtol=0, atol=0)  # [E, H, I/2]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_rank_reads_only_its_cut(root: Path, fmt: str, whole: list[str]) -> None:
    """Both ranks' layers, built without a process group, hold exactly their slice of one
    process's layer (dequantized, bit for bit; row-parallel ones their columns), and no
    packed tensor of a quantized layer (weight, qweight, qzeros, scales) is ever read
    whole on a rank, by the float load or the quantized one."""
    import torch

    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model

    path, _ = write_quantized(checkpoint("llama", root), fmt, root)
    one = dict(load_model(ModelConfig(path, pack_weights=False)).model.named_modules())
    packed = (".weight", ".qweight", ".qzeros", ".scales")
    whole.clear()  # what one process read above: the ranks' reads from here on
    for rank in range(2):
        model, count, owners = _rank_model(path, rank)
        assert count == 14  # q, k, v, o, gate, up, down in two layers
        assert not [k for k in whole if k.endswith(packed) and k.rpartition(".")[0]
                    in owners], whole
        checked = 0
        for name, mod in model.named_modules():
            if isinstance(mod, ReducedQuant):  # row-parallel: this rank's input columns
                inner: Any = mod.inner
                got = inner.dequantized()
                want = one[name].dequantized().chunk(2, dim=1)[rank]  # [N, K / 2]
            elif hasattr(mod, "dequantized") and not name.endswith(".inner"):
                got, full = mod.dequantized(), one[name].dequantized()  # [N', K], [N, K]
                want = full.chunk(2, dim=0)[rank]
            else:
                continue
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
            checked += 1
        assert checked == 14
