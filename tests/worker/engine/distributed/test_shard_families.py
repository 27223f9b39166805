"""The dense families with layouts of their own, sharded over two gloo ranks, score every
token as the unsharded model does (logits within 1e-5), with every parameter drawn, biases
and per-head norms included, so a fused projection cut as one slice, a bias added on both
ranks or a per-head norm left whole shows; and each rank holds about half the weights, so
a projection left whole (replicated) shows too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from tests.family_checkpoints import FAMILIES
from worker.engine.distributed.fused import gate_up_rows, qkv_rows
from worker.engine.distributed.group import GroupSpec, close_group, init_group
from worker.engine.distributed.shard_model import shard_model
from worker.engine.distributed.tp_config import TPConfig

SIZE = 2
# biases and the optional per-head q/k norms switched on where the family has them
EXTRA: dict[str, dict[str, Any]] = {
    "granite": dict(attention_bias=True, mlp_bias=True),
    "glm4": dict(attention_bias=True),
    "cohere": dict(use_qk_norm=True, attention_bias=True),
    "cohere2": dict(attention_bias=True),
    "smollm3": dict(attention_bias=True, mlp_bias=True),
}
NAMES = ["gemma3", "granite", "smollm3", "starcoder2", "qwen2_window", "phi3",
         "phi3_partial", "glm4", "cohere", "cohere2", "gpt_neox"]


def _model(family: str) -> torch.nn.Module:
    spec = dict(FAMILIES[family])
    config = getattr(transformers, spec.pop("cls"))(
        vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=64, pad_token_id=0, **spec, **EXTRA.get(family, {}))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # all drawn: zero biases and unit norms would hide a bad cut
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


def _rank(rank: int, family: str, init_method: str) -> None:
    torch.set_num_threads(1)
    init_group(TPConfig(size=SIZE, rank=rank), GroupSpec(init_method, 30.0), "cpu")
    try:
        ids = torch.tensor([[5, 17, 3, 60, 9, 44, 2, 31, 7, 12, 50, 1, 33, 8, 21, 40, 6,
                             19, 27, 11]])  # longer than the 16-token windows
        with torch.no_grad():
            want = _model(family)(ids, use_cache=False).logits  # [1, T, vocab]
            sharded = shard_model(_model(family), TPConfig(size=SIZE, rank=rank))
            got = sharded(ids, use_cache=False).logits
        full_numel = sum(p.numel() for p in _model(family).parameters())
        assert sum(p.numel() for p in sharded.parameters()) < 0.6 * full_numel
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        close_group()


@pytest.mark.parametrize("family", NAMES)
def test_two_ranks_equal_one(family: str, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(family, f"file://{tmp_path}/rendezvous"), nprocs=SIZE, join=True)


def test_fused_rows_take_each_part_not_one_slice() -> None:
    # q: 4 heads, k and v: 2 heads each, of 2 dims: rank 1 gets q heads 2-3, k/v head 1
    assert qkv_rows(4, 2, (2, 4), 2, (1, 2)).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    # gate 4 units then up 4 units: rank 0 gets gate 0-1 and up 0-1
    assert gate_up_rows(4, 0, 2).tolist() == [0, 1, 4, 5]
