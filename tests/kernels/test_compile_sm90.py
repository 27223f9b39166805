"""Ahead-of-time compile the kernels for an H100 (sm_90) on the CPU, no GPU needed.

The interpreter runs kernels with numpy and accepts code the real compiler rejects
(``tl.dot`` operands under 16 rows, loop-carried values changing type, ...). Compiling
each kernel variant down to a cubin with the ptxas shipped in the triton wheel catches
that class of bug in CI. It runs in a subprocess because ``TRITON_INTERPRET=1``, set for
the other tests, makes ``@triton.jit`` return interpreter objects that cannot be compiled.

``test_attention_kernels_do_not_spill_on_sm90`` reports registers and spills of the
attention kernels over the model shapes that matter (head_dim 64/80/128/256, GQA groups
1/4/8, fp16/bf16). It compiles the variants a real launch builds: the launchers run on CPU
tensors with their kernels swapped for recorders, and each recorded launch is specialized
by Triton's own launch-time rule (16-byte aligned pointers and ints divisible by 16 get a
divisibility hint, ints equal to 1 become constants). Without those hints the K/V gathers
cannot be vectorized and the same kernels reach 255 registers and spill, which is what an
AOT compile with a bare signature reports; that variant is never launched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

POINTER_DTYPES = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
FLOAT_ARGS = {"scale", "soft_cap"}


def _compile(fn, dtype: str, constexprs: dict, pointers: dict | None = None) -> None:
    """Compile ``fn`` for sm_90: ``*_ptr`` args get ``dtype`` unless named in ``pointers``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = POINTER_DTYPES | (pointers or {})
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, dtype)
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))


def compile_variants() -> None:
    """One compile per structurally different variant (flags, dtypes, tile shapes)."""
    from kernels.decode_attention import _decode_reduce_kernel, _decode_split_kernel
    from kernels.prefill_attention import _prefill_kernel
    from kernels.store_kv import _store_kv_kernel

    decode = dict(GROUP=4, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=80, HEAD_DIM_PAD=128, PAGE_SIZE=16,
                  SLIDING=True, SOFT_CAP=True, WRITE_PARTIAL=True, UPCAST=False,
                  V_DIM=80, V_DIM_PAD=128, PE_DIM=0, PE_PAD=16, HEAD_BLOCKS=1)  # fmt: skip
    partial = {"out_ptr": "fp32", "lse_ptr": "fp32"}
    _compile(_decode_split_kernel, "fp16", decode, partial)
    big = decode | dict(HEAD_DIM=256, HEAD_DIM_PAD=256, BLOCK_N=32, GROUP=32, GROUP_PAD=32,
                        SLIDING=False, SOFT_CAP=False, WRITE_PARTIAL=False, V_DIM=256,
                        V_DIM_PAD=256)  # fmt: skip
    _compile(_decode_split_kernel, "bf16", big)
    _compile(_decode_split_kernel, "fp32", decode | dict(HEAD_DIM=64, HEAD_DIM_PAD=64, V_DIM=64,
                                                         V_DIM_PAD=64), partial)
    # MLA's latent cache: values inside the keys, the rope columns apart, heads in blocks
    latent = decode | dict(HEAD_DIM=576, HEAD_DIM_PAD=1024, V_DIM=512, V_DIM_PAD=512,
                           PE_DIM=64, PE_PAD=64, BLOCK_N=16, GROUP=128, HEAD_BLOCKS=8,
                           SLIDING=False, SOFT_CAP=False)  # fmt: skip
    _compile(_decode_split_kernel, "bf16", latent, partial)
    reduce = dict(HEAD_DIM=80, HEAD_DIM_PAD=128, SPLITS_PAD=64)
    _compile(_decode_reduce_kernel, "bf16", reduce, {"part_ptr": "fp32", "lse_ptr": "fp32"})

    prefill = dict(GROUP=8, GROUP_PAD=8, BLOCK_Q=8, BLOCK_N=64, HEAD_DIM=128, HEAD_DIM_PAD=128,
                   PAGE_SIZE=16, SLIDING=True, SOFT_CAP=True, UPCAST=False, V_DIM=128,
                   V_DIM_PAD=128, PE_DIM=0, PE_PAD=16, HEAD_BLOCKS=1)  # fmt: skip
    _compile(_prefill_kernel, "bf16", prefill)
    _compile(_prefill_kernel, "bf16", prefill | dict(
        HEAD_DIM=576, HEAD_DIM_PAD=1024, V_DIM=512, V_DIM_PAD=512, PE_DIM=64, PE_PAD=64,
        GROUP=128, GROUP_PAD=16, BLOCK_Q=1, BLOCK_N=16, HEAD_BLOCKS=8, SLIDING=False,
        SOFT_CAP=False))
    # the search over sequences with a known count of 1 (not specialized at launch any more,
    # but the code must stay valid for any count)
    one_seq = prefill | dict(GROUP=1, GROUP_PAD=1, BLOCK_Q=64, SLIDING=False, num_seqs=1)
    _compile(_prefill_kernel, "fp16", one_seq)

    store = dict(PAGE_SIZE=16, BLOCK_H=1, HEAD_DIM=96, HEAD_DIM_PAD=128, num_kv_heads=1,
                 V_DIM=96, V_DIM_PAD=128)
    _compile(_store_kv_kernel, "bf16", store,
             {"key_ptr": "fp32", "value_ptr": "fp32", "slot_mapping_ptr": "i64"})  # fmt: skip

    from kernels.lora import _expand_kernel, _shrink_kernel

    segments = {"tokens_ptr": "i32", "starts_ptr": "i32"}
    shrink = dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=64, UPCAST=False)
    _compile(_shrink_kernel, "bf16", shrink, segments | {"out_ptr": "fp32"})
    _compile(_shrink_kernel, "fp32", shrink | dict(BLOCK_R=64), segments | {"out_ptr": "fp32"})
    expand = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_R=16)
    _compile(_expand_kernel, "bf16", expand, segments | {"t_ptr": "fp32", "scale_ptr": "fp32"})

    from kernels import sampling

    # Triton 3.6 (the CUDA image's) failed this kernel in TritonGPURemoveLayoutConversions
    # ("operand does not dominate this use") until the 2-D views were built once per chunk
    tables = dict(params_ptr="fp32", keys_ptr="i64", bias_off_ptr="i32", bias_tok_ptr="i32",
                  bias_val_ptr="fp32", out_ptr="i64", passes_ptr="i32")
    for dtype, bias in (("bf16", False), ("fp32", True)):
        _compile(sampling._sample_kernel, dtype,
                 dict(BLOCK=sampling.BLOCK, NB=sampling.NB, SPAN=sampling.SPAN,
                      MAX_LEVELS=sampling.MAX_LEVELS, HAS_BIAS=bias), tables)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` is recorded."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def _launch_source(fn, args: tuple, kwargs: dict):
    """(ASTSource, options) of the variant Triton would build for this launch."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    bound = dict(zip(fn.arg_names, args, strict=False))  # positional args, then keywords
    bound |= {k: v for k, v in kwargs.items() if k in fn.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}  # num_warps, ...
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(CUDABackend, value, False,
                                           not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":  # an int equal to 1
            constexprs[param.name] = key
        elif isinstance(key, str) and key:
            attrs[(i,)] = CUDABackend.parse_attr(key)
    return ASTSource(fn, signature, constexprs, attrs), options


def _ptxas_usage(fn, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) from ptxas -v for sm_90a."""
    import contextlib
    import io
    import re

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    src, options = _launch_source(fn, args, kwargs)
    knobs.nvidia.dump_ptxas_log = True  # the compile prints ptxas -v's report
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert regs and spills, f"no ptxas report for {fn.__name__} (cached compile?):\n{text}"
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


def _record_launches(dtype, head_dim: int, group: int) -> dict[str, list]:
    """The attention launchers on CPU tensors of a model shape (8 KV heads, pages of 16):
    decode with one split and with four (stage 1 writing partials, then the merge), and a
    prefill of two 100-token chunks. Returns each kernel's recorded launches."""
    import torch

    from kernels import decode_attention, prefill_attention

    names = [(decode_attention, "_decode_split_kernel"),
             (decode_attention, "_decode_reduce_kernel"), (prefill_attention, "_prefill_kernel")]
    recorders = {name: _Recorder(getattr(mod, name)) for mod, name in names}
    num_kv_heads, page = 8, 16
    q = torch.zeros(4, num_kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(2, 40, page, num_kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(4, 10, dtype=torch.int32)
    lens = torch.full((4,), 100, dtype=torch.int32)
    prefill_q = torch.zeros(200, num_kv_heads * group, head_dim, dtype=dtype)
    starts = torch.tensor([0, 100, 200], dtype=torch.int32)
    for mod, name in names:
        setattr(mod, name, recorders[name])
    try:
        for splits in (1, 4):
            decode_attention.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.1,
                                                    num_kv_splits=splits)
        prefill_attention.paged_prefill_attention(
            prefill_q, cache[0], cache[1], tables[:2], starts, lens[:2], 0.1, max_query_len=100)
    finally:
        for mod, name in names:
            setattr(mod, name, recorders[name].fn)
    return {name: rec.calls for name, rec in recorders.items()}


def register_report() -> None:
    """Print one JSON line per compiled variant: shape, kernel, registers, spill bytes."""
    import itertools

    import torch

    seen: set[str] = set()
    for dtype, head_dim, group in itertools.product(
            (torch.float16, torch.bfloat16), (64, 80, 128, 256), (1, 4, 8)):
        for kernel, calls in _record_launches(dtype, head_dim, group).items():
            fn = getattr(_kernel_module(kernel), kernel)
            for args, kwargs in calls:
                src, options = _launch_source(fn, args, kwargs)
                key = src.hash() + repr(sorted(options.items()))
                if key in seen:  # e.g. the merge kernel does not depend on the group
                    continue
                seen.add(key)
                regs, spill = _ptxas_usage(fn, args, kwargs)
                print(json.dumps({"dtype": str(dtype).removeprefix("torch."),
                                  "head_dim": head_dim, "group": group, "kernel": kernel,
                                  "partial": bool(kwargs.get("WRITE_PARTIAL", False)),
                                  "registers": regs, "spill_bytes": spill}), flush=True)


def _record_latent_launches(num_q_heads: int) -> dict[str, list]:
    """The launches over MLA's latent cache at DeepSeek-V3's widths (one KV head of a
    512-wide latent and a 64-wide rope key, V its first 512 columns; bf16), as
    ``_record_launches`` records them."""
    import torch

    from kernels import decode_attention, prefill_attention
    from worker.engine.kv.pool import PoolLayout

    names = [(decode_attention, "_decode_split_kernel"),
             (decode_attention, "_decode_reduce_kernel"), (prefill_attention, "_prefill_kernel")]
    recorders = {name: _Recorder(getattr(mod, name)) for mod, name in names}
    layout = PoolLayout(1, 1, 576, 512, v_in_k=True)
    _, caches = layout.allocate(40, 16, torch.bfloat16, torch.device("cpu"))
    k_cache, v_cache = caches[0]
    q = torch.zeros(4, num_q_heads, 576, dtype=torch.bfloat16)
    tables = torch.zeros(4, 10, dtype=torch.int32)
    lens = torch.full((4,), 100, dtype=torch.int32)
    prefill_q = torch.zeros(200, num_q_heads, 576, dtype=torch.bfloat16)
    starts = torch.tensor([0, 100, 200], dtype=torch.int32)
    for mod, name in names:
        setattr(mod, name, recorders[name])
    try:
        for splits in (1, 4):
            decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                    num_kv_splits=splits)
        prefill_attention.paged_prefill_attention(
            prefill_q, k_cache, v_cache, tables[:2], starts, lens[:2], 0.1, max_query_len=100)
    finally:
        for mod, name in names:
            setattr(mod, name, recorders[name].fn)
    return {name: rec.calls for name, rec in recorders.items()}


def latent_register_report() -> None:
    """One JSON line per compiled latent-MLA variant, 16 and 128 query heads."""
    seen: set[str] = set()
    for heads in (16, 128):
        for kernel, calls in _record_latent_launches(heads).items():
            fn = getattr(_kernel_module(kernel), kernel)
            for args, kwargs in calls:
                src, options = _launch_source(fn, args, kwargs)
                key = src.hash() + repr(sorted(options.items()))
                if key in seen:
                    continue
                seen.add(key)
                regs, spill = _ptxas_usage(fn, args, kwargs)
                print(json.dumps({"heads": heads, "kernel": kernel, "registers": regs,
                                  "partial": bool(kwargs.get("WRITE_PARTIAL", False)),
                                  "spill_bytes": spill}), flush=True)


def _kernel_module(kernel: str) -> Any:
    from kernels import decode_attention, prefill_attention

    return prefill_attention if kernel == "_prefill_kernel" else decode_attention


def _has_ptxas() -> bool:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return os.access(get_ptxas(90).path, os.X_OK)
    except Exception:  # noqa: BLE001 - no usable ptxas, whatever the reason
        return False


def _run_compiled(tmp_path: Path, code: str, timeout: int) -> subprocess.CompletedProcess:
    env = os.environ | {
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),  # empty: every variant really runs ptxas
        "TRITON_DEFAULT_FP_FUSION": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


needs_ptxas = pytest.mark.skipif(not _has_ptxas(), reason="triton's NVIDIA backend/ptxas absent")


@needs_ptxas
def test_kernels_compile_for_sm90(tmp_path):
    _run_compiled(tmp_path, "import test_compile_sm90 as t; t.compile_variants()", 300)


@needs_ptxas
def test_attention_kernels_do_not_spill_on_sm90(tmp_path):
    proc = _run_compiled(tmp_path, "import test_compile_sm90 as t; t.register_report()", 900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print("\n".join(f"{r['kernel']:<22} {r['dtype']:<9} d={r['head_dim']:<3} g={r['group']} "
                    f"partial={r['partial']!s:<5} regs={r['registers']:>3} "
                    f"spill={r['spill_bytes']}" for r in rows))
    shapes = {(r["dtype"], r["head_dim"], r["group"]) for r in rows}
    assert len(shapes) == 24
    for kernel in ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"):
        assert any(r["kernel"] == kernel for r in rows), kernel
    spilling = [r for r in rows if r["spill_bytes"]]
    assert not spilling, spilling


@needs_ptxas
def test_latent_mla_kernels_do_not_spill_on_sm90(tmp_path):
    """DeepSeek-V3's latent cache (576-wide keys, 128 query heads on one KV head): the
    kernels take LATENT_ROWS query heads a program, and none spills."""
    proc = _run_compiled(tmp_path, "import test_compile_sm90 as t; t.latent_register_report()",
                         600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print("\n".join(f"{r['kernel']:<22} heads={r['heads']:<3} partial={r['partial']!s:<5} "
                    f"regs={r['registers']:>3} spill={r['spill_bytes']}" for r in rows))
    for kernel in ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"):
        assert any(r["kernel"] == kernel for r in rows), kernel
    spilling = [r for r in rows if r["spill_bytes"]]
    assert not spilling, spilling
