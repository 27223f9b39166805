"""Ahead-of-time compile the kernels for an H100 (sm_90) on the CPU, no GPU needed.

The interpreter runs kernels with numpy and accepts code the real compiler rejects
(``tl.dot`` operands under 16 rows, loop-carried values changing type, ...). Compiling
each kernel variant down to a cubin with the ptxas shipped in the triton wheel catches
that class of bug in CI. It runs in a subprocess because ``TRITON_INTERPRET=1``, set for
the other tests, makes ``@triton.jit`` return interpreter objects that cannot be compiled.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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
                  SLIDING=True, SOFT_CAP=True, WRITE_PARTIAL=True, UPCAST=False)  # fmt: skip
    partial = {"out_ptr": "fp32", "lse_ptr": "fp32"}
    _compile(_decode_split_kernel, "fp16", decode, partial)
    # ints equal to 1 (num_splits here) are specialised to constexprs at launch
    big = decode | dict(HEAD_DIM=256, HEAD_DIM_PAD=256, BLOCK_N=32, GROUP=32, GROUP_PAD=32,
                        SLIDING=False, SOFT_CAP=False, WRITE_PARTIAL=False)  # fmt: skip
    big["num_splits"] = 1
    _compile(_decode_split_kernel, "bf16", big)
    _compile(_decode_split_kernel, "fp32", decode | dict(HEAD_DIM=64, HEAD_DIM_PAD=64), partial)
    reduce = dict(HEAD_DIM=80, HEAD_DIM_PAD=128, SPLITS_PAD=64)
    _compile(_decode_reduce_kernel, "bf16", reduce, {"part_ptr": "fp32", "lse_ptr": "fp32"})

    prefill = dict(GROUP=8, GROUP_PAD=8, BLOCK_Q=8, BLOCK_N=64, HEAD_DIM=128, HEAD_DIM_PAD=128,
                   PAGE_SIZE=16, SLIDING=True, SOFT_CAP=True, UPCAST=False)  # fmt: skip
    _compile(_prefill_kernel, "bf16", prefill)
    # a single sequence: num_seqs == 1 becomes a constexpr, the binary search must cope
    one_seq = prefill | dict(GROUP=1, GROUP_PAD=1, BLOCK_Q=64, SLIDING=False, num_seqs=1)
    _compile(_prefill_kernel, "fp16", one_seq)

    store = dict(PAGE_SIZE=16, BLOCK_H=1, HEAD_DIM=96, HEAD_DIM_PAD=128, num_kv_heads=1)
    _compile(_store_kv_kernel, "bf16", store,
             {"key_ptr": "fp32", "value_ptr": "fp32", "slot_mapping_ptr": "i64"})  # fmt: skip


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="triton has no NVIDIA backend here",
)
def test_kernels_compile_for_sm90(tmp_path):
    env = os.environ | {
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
    }
    code = "import test_compile_sm90 as t; t.compile_variants()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
