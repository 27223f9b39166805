"""The lean CPU decode path per model family: decode tokens/s of Ferry's lean path, Ferry's
module path and transformers' ``generate``, side by side in one run.

For each family the lean path describes (``worker/engine/runner/cpu/layer_plan.py``) a
seeded checkpoint of ``tests/family_checkpoints.py`` is built larger than the tests' (by
default hidden 256, 4 layers, fp32; each family's features as there: windows of 16, soft
caps, q/k norms, fused projections, MoE blocks of 4 experts choosing 2). Three ways, all
greedy on the same prompts (``--batch`` prompts of 8 random tokens, ``--new`` new tokens
each), alternating for ``--rounds`` rounds:

- ``lean``: a Ferry engine with the lean decode path (the default on a CPU);
- ``modules``: the same engine config with ``lean_decode=False`` (transformers' modules
  around Ferry's kernels);
- ``hf``: transformers' ``generate`` on the same checkpoint (``attn_implementation``
  eager: the one every family supports, soft caps included), the batch in one call.

Decode throughput only: an engine's first step (the prompts' prefill) is left out of its
clock and tokens; ``generate``'s decode time is that of ``--new`` new tokens less that of
one. Reported per family: the median decode tokens/s (wall and process CPU time; CPU time
is the steadier on a shared machine), lean over modules and lean over ``hf``, and whether
the lean path gave the module path's tokens (it must: it is bit-equal) and
transformers' (it may differ at a near-tie). One torch thread by default (``--threads``).

    .venv/bin/python ops/bench/techniques/lean_families.py [--rounds 3] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.family_checkpoints import build_family  # noqa: E402
from worker.engine.runner.cpu.layer_plan import FAMILIES as DESCRIBED  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral",
            "qwen3_moe"]
PROMPT_LEN = 8
Run = tuple[float, float, int, list[list[int]]]  # decode wall s, cpu s, tokens, outputs


def _engine(path: str, lean: bool) -> Any:
    from worker import Engine, EngineConfig

    engine = Engine(EngineConfig.create(path, device="cpu", lean_decode=lean,
                                        enable_prefix_caching=False, num_blocks=256,
                                        block_size=16))
    assert (engine.runner.lean is not None) == lean, "the lean path was meant to be built"
    return engine


def _engine_run(engine: Any, prompts: list[list[int]], new: int) -> Run:
    from protocol.sampling import SamplingParams
    from worker.engine.output.text_output import TextOutputs

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=new,
                                                          ignore_eos=True))
    out: list[list[int]] = [[] for _ in prompts]
    steps = TextOutputs.of(engine)
    first = 0
    for o in steps.step():  # the prefill: not timed
        out[int(o.request_id)] += o.new_token_ids
        first += len(o.new_token_ids)
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for o in steps.step():
            out[int(o.request_id)] += o.new_token_ids
    tokens = len(prompts) * new - first
    return time.perf_counter() - wall, time.process_time() - cpu, tokens, out


def _hf_generate(model: Any, ids: torch.Tensor, new: int) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return time.perf_counter() - wall, time.process_time() - cpu, gen


def _hf_run(model: Any, prompts: list[list[int]], new: int) -> Run:
    ids = torch.tensor(prompts)
    one_wall, one_cpu, _ = _hf_generate(model, ids, 1)
    wall, cpu, gen = _hf_generate(model, ids, new)
    outs = gen[:, PROMPT_LEN:].tolist()
    return wall - one_wall, cpu - one_cpu, len(prompts) * (new - 1), outs


def bench_family(family: str, root: Path, batch: int, new: int, rounds: int, hidden: int,
                 layers: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = build_family(family, root, hidden=hidden, layers=layers)
    runners = {"lean": _engine(path, True), "modules": _engine(path, False)}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos
    rng = random.Random(batch)
    vocab = runners["lean"].runner.shape.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
    runs: dict[str, list[Run]] = {name: [] for name in ("lean", "modules", "hf")}
    with torch.inference_mode():
        _hf_run(hf, prompts, 4)  # warm-up
        for engine in runners.values():
            _engine_run(engine, prompts, 4)
        for _ in range(rounds):
            for name, engine in runners.items():
                runs[name].append(_engine_run(engine, prompts, new))
            runs["hf"].append(_hf_run(hf, prompts, new))
    row: dict[str, Any] = dict(family=family, cls=DESCRIBED[_model_type(family)].causal_lm,
                               batch=batch, new_tokens=new)
    for name, rows in runs.items():
        row[f"{name}_wall_tok_s"] = statistics.median(t / w for w, _, t, _ in rows)
        row[f"{name}_cpu_tok_s"] = statistics.median(t / c for _, c, t, _ in rows)
    for other in ("modules", "hf"):
        row[f"lean_over_{other}_cpu"] = row["lean_cpu_tok_s"] / row[f"{other}_cpu_tok_s"]
        row[f"lean_over_{other}_wall"] = row["lean_wall_tok_s"] / row[f"{other}_wall_tok_s"]
    row["lean_tokens_equal_modules"] = runs["lean"][0][3] == runs["modules"][0][3]
    row["lean_tokens_equal_hf"] = runs["lean"][0][3] == runs["hf"][0][3]
    print(f"{family:10} B={batch:<3} " + "  ".join(
        f"{n} {row[f'{n}_cpu_tok_s']:7.1f}" for n in runs) +
        f"  (cpu tok/s)  lean/modules x{row['lean_over_modules_cpu']:.2f}"
        f"  lean/hf x{row['lean_over_hf_cpu']:.2f}"
        f"  same tokens as modules: {row['lean_tokens_equal_modules']},"
        f" as hf: {row['lean_tokens_equal_hf']}", flush=True)
    return row


def _model_type(family: str) -> str:
    return "gemma3_text" if family == "gemma3" else family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--out", default=str(ROOT / "ops/bench/results/lean_families.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="ferry-lean-families-"))
    rows = [bench_family(f, root, b, args.new, args.rounds, args.hidden, args.layers)
            for f in args.families for b in args.batch]
    result = dict(torch=torch.__version__, threads=args.threads, rounds=args.rounds,
                  hidden=args.hidden, layers=args.layers, prompt_len=PROMPT_LEN, rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
