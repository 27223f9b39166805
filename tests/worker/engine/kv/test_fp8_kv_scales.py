"""Per-layer scales of an FP8 KV cache, read from the checkpoint (``k_scale``/``v_scale``).

The test checkpoint is the tiny Llama with its keys blown up 200x and its values 50x
(queries and ``o_proj`` shrunk to match, so the fp32 model computes the same function):
its K/V run far past e4m3's 448. With the checkpoint's scales the FP8 cache computes what
the original checkpoint's does; without them it saturates, and its logprobs are far off.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.worker.engine.kv.test_fp8_kv_cache import _engine, _run
from worker.engine.runner.attention.kv_scales import KV_SCALE_ATTR, read_kv_scales

K_SCALE, V_SCALE = 200.0, 50.0


def _blown_up(root: Path, with_scales: bool) -> str:
    from safetensors.torch import load_file, save_file

    src = build_checkpoint("llama", root)
    dst = root / ("scaled" if with_scales else "unscaled")
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    state = load_file(str(file))
    layers = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.")}
    for i in layers:
        attn = f"model.layers.{i}.self_attn"
        state[f"{attn}.k_proj.weight"] *= K_SCALE
        state[f"{attn}.q_proj.weight"] /= K_SCALE
        state[f"{attn}.v_proj.weight"] *= V_SCALE
        state[f"{attn}.o_proj.weight"] /= V_SCALE
        if with_scales:
            state[f"{attn}.k_scale"] = torch.tensor(K_SCALE)
            state[f"{attn}.v_scale"] = torch.tensor(V_SCALE)
    save_file(state, str(file), metadata={"format": "pt"})
    return str(dst)


def _logprob_error(got, want) -> float:
    """Mean |logprob difference| of the fp32 run's tokens up to the first divergence; a
    token missing from the FP8 run's top 5 counts as 10."""
    diffs = []
    for g, w in zip(got, want, strict=True):
        for (g_tok, g_top), (w_tok, w_top) in zip(g, w, strict=True):
            diffs.append(abs(g_top[w_tok] - w_top[w_tok]) if w_tok in g_top else 10.0)
            if g_tok != w_tok:
                break
    return sum(diffs) / len(diffs)


def test_checkpoint_scales_undo_the_range(tmp_path) -> None:
    """The scaled checkpoint on FP8 computes what the original checkpoint does on FP8 (the
    same tokens, logprobs within 1e-3: the scales cancel up to fp32 rounding); without
    its scales it saturates: its logprobs are several times further from fp32's."""
    rng = random.Random(5)
    jobs = [(f"r{i}", [rng.randrange(300) for _ in range(n)], 10)
            for i, n in enumerate([3, 40, 17, 70])]
    original = _run(_engine(build_checkpoint("llama", tmp_path), "fp8_e4m3", "cpu",
                            num_blocks=64), jobs, {})
    errors = {}
    for with_scales in (True, False):
        path = _blown_up(tmp_path, with_scales)
        want = _run(_engine(path, "float32", "cpu", num_blocks=64), jobs, {})
        engine = _engine(path, "fp8_e4m3", "cpu", num_blocks=64)
        attn = engine.runner.model.model.layers[1].self_attn
        assert getattr(attn, KV_SCALE_ATTR, None) == ((K_SCALE, V_SCALE) if with_scales
                                                      else None)
        assert (engine.runner.lean is None) == with_scales
        got = _run(engine, jobs, {})
        if with_scales:
            for rid, _, _ in jobs:
                assert [t for t, _ in got[rid]] == [t for t, _ in original[rid]], rid
                for (tok, top), (_, top0) in zip(got[rid], original[rid], strict=True):
                    assert abs(top[tok] - top0[tok]) < 1e-3, rid
        errors[with_scales] = _logprob_error([got[r] for r, _, _ in jobs],
                                                 [want[r] for r, _, _ in jobs])
    assert errors[True] * 3 < errors[False], errors  # 0.56 against 2.66 today


def test_bad_scales_are_refused(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(2.0),
               "model.layers.0.self_attn.v_scale": torch.tensor(2.0)},
              str(tmp_path / "a.safetensors"))
    assert read_kv_scales(str(tmp_path), 1) == [(2.0, 2.0)]
    with pytest.raises(ValueError, match="incomplete: no layer 1 k_scale"):
        read_kv_scales(str(tmp_path), 2)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)},
              str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="must be finite and > 0"):
        read_kv_scales(str(tmp_path), 1)
    (tmp_path / "b.safetensors").unlink()
    save_file({"model.layers.0.self_attn.v_scale": torch.ones(4)},
              str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="only per-layer"):
        read_kv_scales(str(tmp_path), 1)
    assert read_kv_scales(str(tmp_path / "nowhere"), 1) is None
