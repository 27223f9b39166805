"""The fused sampling kernel, token for token: against its torch twin
(``kernels.sampling_reference``) and against the sampler as it was before the fused pass
(``ops.bench.techniques.sampling_traffic.old_sample``: the sort-based filters and the noise over
``[rows, vocab]``), with seeded keys, for each parameter and their mixes. Runs under the
Triton interpreter on CPU (4 rows x 1000 tokens), compiled on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sampling import sample as fused
from kernels.sampling_reference import sample as twin
from ops.bench.techniques.sampling_traffic import old_sample
from protocol.sampling import SamplingParams
from worker.engine.sample.sampler import Sampler, SamplingRow, sampling_tensors

VOCAB = 1000
INF = float("inf")

CASES = {
    "greedy_mixed": [{"temperature": 0}, {"temperature": 0.8}, {"top_k": 1},
                     {"temperature": 1.2, "top_p": 0.9}],
    "temperature": [{"temperature": t} for t in (0.5, 0.8, 1.0, 1.5)],
    "top_k": [{"top_k": k} for k in (2, 10, 50, 999)],
    "top_p": [{"top_p": p, "temperature": 0.9} for p in (0.3, 0.8, 0.95, 0.99)],
    "min_p": [{"min_p": m} for m in (0.01, 0.05, 0.1, 0.3)],
    "logit_bias": [{"logit_bias": {5: 10.0, 7: -100.0}},
                   {"temperature": 0, "logit_bias": {9: 50.0}},
                   {"logit_bias": {0: 5.0, 999: 3.0}, "top_p": 0.9}, {}],
    "mixed": [{"top_k": 20, "top_p": 0.8}, {"min_p": 0.05, "top_p": 0.9, "temperature": 0.7},
              {"top_k": 40, "top_p": 0.95, "min_p": 0.02, "logit_bias": {3: 4.0}},
              {"temperature": 0, "logit_bias": {11: 20.0}}],
    "no_op_filters": [{"top_p": 1.0}, {"top_k": VOCAB}, {"top_k": 5000}, {"temperature": 100.0}],
}


def rows_of(params: list[dict], index: int, seed: int) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(seed=seed + i, **p), index, [1, 2], [])
            for i, p in enumerate(params)]


def keys_of(rows: list[SamplingRow]) -> list[int]:
    return [Sampler()._key(r) for r in rows]


def logits_for(seed: int, rows: int = 4, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3.0  # [R, V]


def three_ways(logits: torch.Tensor, rows: list[SamplingRow], device: torch.device):
    keys = keys_of(rows)
    on_device = sampling_tensors(rows, keys, device)
    kernel = fused(logits.to(device), on_device).cpu()
    reference = twin(logits, sampling_tensors(rows, keys, torch.device("cpu")))
    return kernel.tolist(), reference.tolist(), old_sample(logits, rows, keys).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_twin_and_old_sampler_draw_the_same_tokens(case, device):
    for trial in range(3):
        rows = rows_of(CASES[case], index=trial * 7, seed=100 * trial)
        kernel, reference, old = three_ways(logits_for(trial), rows, device)
        assert kernel == reference == old, (case, trial)


def test_seeded_draws_vary_with_the_key_and_follow_the_distribution(device):
    """Many keys over one row: the kernel's draws are the twin's, and they spread."""
    logits = logits_for(5, rows=1, vocab=64).expand(16, -1).contiguous()
    rows = [SamplingRow(SamplingParams(seed=3, top_p=0.9), i, [1], []) for i in range(16)]
    kernel, reference, old = three_ways(logits, rows, device)
    assert kernel == reference == old
    assert len(set(kernel)) > 3


def test_minus_inf_logits_are_never_drawn(device):
    logits = logits_for(7)
    logits[:, ::2] = -INF  # every even token impossible
    logits[0, 1:500] = -INF
    rows = rows_of([{"temperature": 2.0}, {"top_p": 0.5}, {"top_k": 600}, {"min_p": 0.2}], 3, 9)
    kernel, reference, old = three_ways(logits, rows, device)
    assert kernel == reference == old
    assert all(t % 2 == 1 for t in kernel)


def test_all_masked_rows_give_token_zero_as_before(device):
    """A row with nothing left to draw (all -inf) is defined as token 0, greedy or not:
    the old path's argmax over NaN probabilities gave the same."""
    logits = logits_for(8)
    logits[1] = -INF
    logits[2] = -INF
    rows = rows_of([{}, {"temperature": 0}, {"top_p": 0.5}, {}], 0, 1)
    kernel, reference, old = three_ways(logits, rows, device)
    assert kernel == reference == old
    assert kernel[1] == kernel[2] == 0


def test_ties_keep_the_whole_tie_group_and_greedy_takes_the_first(device):
    """Quantized logits: many exact ties. Greedy takes the lowest tied id (as torch's
    argmax); a tie group at a top-k or top-p boundary is kept whole, in the kernel and
    its twin alike."""
    logits = (logits_for(9) * 2).round() / 2  # steps of 0.5: hundreds of ties per row
    rows = rows_of([{"temperature": 0}, {"top_k": 7}, {"top_p": 0.6}, {"top_k": 30, "top_p": 0.9}],
                   2, 4)
    keys = keys_of(rows)
    kernel = fused(logits.to(device), sampling_tensors(rows, keys, device)).cpu()
    assert kernel.tolist() == twin(logits, sampling_tensors(rows, keys, logits.device)).tolist()
    assert kernel[0] == logits[0].argmax()
    top = logits[1].sort(descending=True).values
    assert logits[1, kernel[1]] >= top[6]  # never under the 7th value, ties included


def test_bfloat16_logits_are_read_as_they_are(device):
    logits = logits_for(11).to(torch.bfloat16)
    rows = rows_of(CASES["mixed"], 4, 12)
    keys = keys_of(rows)
    kernel = fused(logits.to(device), sampling_tensors(rows, keys, device)).cpu()
    reference = twin(logits, sampling_tensors(rows, keys, logits.device))
    assert kernel.tolist() == reference.tolist()


def test_passes_greedy_once_temperature_twice_top_p_rarely_more(device):
    logits = logits_for(12, rows=8)
    params = [{"temperature": 0}, {"temperature": 0.7}] + [{"top_p": 0.9}] * 6
    rows = rows_of(params, 0, 3)
    passes = torch.zeros(8, dtype=torch.int32, device=device)
    fused(logits.to(device), sampling_tensors(rows, keys_of(rows), device), passes)
    assert passes[:2].tolist() == [1, 2]
    assert all(2 <= p <= 4 for p in passes[2:].tolist())


def test_the_sampler_matches_the_old_path_with_every_feature():
    """The sampler (twin on CPU, kernel on a GPU) with penalties, masks, bad words and
    logprobs around the fused pass: the old path's tokens, unseeded rows included."""
    logits = logits_for(13, rows=6)
    params = [{"repetition_penalty": 1.3, "top_k": 5}, {"allowed_token_ids": [1, 4, 9, 16]},
              {"frequency_penalty": 0.5, "logprobs": 2}, {"temperature": 0, "logprobs": 1},
              {"logit_bias": {8: 9.0}, "min_p": 0.1}, {"top_p": 0.7}]
    rows = [SamplingRow(SamplingParams(seed=None if i == 5 else i, **p), 3, [1, 2, 8],
                        [4, 4, 9]) for i, p in enumerate(params)]
    rows[1].bad_words_ids = ((9,),)
    out = Sampler(seed=5)(logits, rows)
    keys = [Sampler()._key(r) for r in rows[:5]]  # seeded (or greedy): no draw
    keys.append(Sampler(seed=5)._key(rows[5]))  # the only unseeded row: the first draw
    assert out.token_ids == old_sample(logits, rows, keys).tolist()
    assert out.token_ids[1] in (1, 4, 16)
    lp = out.logprobs[3]
    assert lp is not None and math.isclose(lp[0], lp[1][0][1])


def test_bad_arguments_are_refused():
    rows = rows_of([{}], 0, 0)
    tensors = sampling_tensors(rows, keys_of(rows), torch.device("cpu"))
    with pytest.raises(ValueError, match="rows"):
        fused(torch.zeros(2, 8), tensors)
    with pytest.raises(ValueError, match="float"):
        fused(torch.zeros(1, 8, dtype=torch.int32), tensors)


_COMPILE = """
import contextlib, io, json, re
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import sampling as s

knobs.nvidia.dump_ptxas_log = True
report = []
for dtype, has_bias in (("fp32", False), ("bf16", True)):
    sig = {"logits_ptr": "*" + dtype, "params_ptr": "*fp32", "keys_ptr": "*i64",
           "bias_off_ptr": "*i32", "bias_tok_ptr": "*i32", "bias_val_ptr": "*fp32",
           "out_ptr": "*i64", "passes_ptr": "*i32", "vocab": "i32", "stride_r": "i32"}
    consts = dict(BLOCK=s.BLOCK, NB=s.NB, SPAN=s.SPAN, MAX_LEVELS=s.MAX_LEVELS,
                  HAS_BIAS=has_bias)
    sig |= {k: "constexpr" for k in consts}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        triton.compile(ASTSource(s._sample_kernel, sig, consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": s.NUM_WARPS})
    spills = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log.getvalue())
    report.append(int(spills.group(1)) + int(spills.group(2)) if spills else -1)
print(json.dumps(report))
"""


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The interpreter accepts what the compiler may reject: compile the real thing for an
    H100 (in a subprocess: TRITON_INTERPRET=1 is on here), fp32 and bf16 logits."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, 0]
