"""Multi-head latent attention's two caches on the tiny seeded DeepSeek-V3 (MLA + MoE):
how many KV bytes a token takes in each, and that both serve transformers' tokens and
logprobs under chunked prefill and preemption (``test_families.py`` runs the default,
latent cache on every path; here the expanded one too, and the latent cache with its
preempted blocks kept in and restored from the host tier).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.family_checkpoints import build_family
from tests.worker.engine.test_families import assert_matches, reference, run_engine

FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_family(FAMILY, tmp_path_factory.mktemp("mla"))


def _config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())  # type: ignore[no-any-return]


def test_latent_cache_holds_the_latent_and_rope_key_per_token(path):
    cfg = _config(path)
    got, engine = run_engine(path, FAMILY)
    runner = engine.runner
    elem = 4  # fp32 on the CPU
    per_token = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem * cfg["num_hidden_layers"]
    assert runner.kv_bytes_per_token == per_token
    assert runner.kv_pool.nbytes == (runner.num_blocks + 1) * runner.block_size * per_token
    k_cache, v_cache = runner.kv_caches[0]
    assert k_cache.data_ptr() == v_cache.data_ptr()  # V is the first kv_lora_rank columns
    assert v_cache.shape[-1] == cfg["kv_lora_rank"]
    assert_matches(got, reference(path, FAMILY), "latent")


def test_expanded_cache_holds_per_head_keys_and_values(path):
    cfg = _config(path)
    got, engine = run_engine(path, FAMILY, mla_latent_cache=False)
    key = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    per_token = cfg["num_attention_heads"] * (key + cfg["v_head_dim"]) * 4 * \
        cfg["num_hidden_layers"]
    assert engine.runner.kv_bytes_per_token == per_token
    assert_matches(got, reference(path, FAMILY), "expanded")


def test_latent_blocks_round_trip_through_the_host_tier(path):
    """Preempted requests' full blocks drop to the host tier and come back from it."""
    got, engine = run_engine(path, FAMILY, host_memory_bytes=64 << 10)
    tier = engine.block_manager.tier
    assert tier is not None and tier.stats.offloaded > 0 and tier.stats.restored > 0
    assert_matches(got, reference(path, FAMILY), "latent + host tier")


def test_deepseek_v3_kv_bytes_per_token_at_full_size():
    """DeepSeek-V3's own config (61 layers, 128 heads, latent 512 + rope 64, keys 192 and
    values 128 per head) in a bf16 cache: the sizes docs/models.md quotes."""
    from transformers import DeepseekV3Config

    from worker.engine.kv.pool import PoolLayout
    from worker.engine.runner.attention.mla import mla_shape
    from worker.engine.runner.model_loader import model_shape

    config = DeepseekV3Config()
    sizes = {}
    for latent in (True, False):
        s = mla_shape(model_shape(config, None), config, latent=latent)
        layout = PoolLayout(s.num_layers, s.num_kv_heads, s.head_dim, s.value_dim, s.v_in_k)
        sizes[latent] = layout.bytes_per_token(2)
    assert sizes[True] == (512 + 64) * 2 * 61 == 70_272
    assert sizes[False] == 128 * (192 + 128) * 2 * 61 == 4_997_120
