"""Single-stream latency: one stream at a time through ``ferry up`` against transformers'
``generate``, same default model, same prompts and ``max_tokens``, in one run.

Ferry: the real stack (``ferry up``: Redis, gateway, one worker with the CPU's threads, as
an operator starts it), one OpenAI streaming completion at a time (greedy, ``ignore_eos``),
timed from the request's send to its last token's arrival at the client. transformers:
``generate`` (greedy, ``use_cache``, fp32 like Ferry's CPU worker, the same torch thread
count, EOS ignored), timed around the call. Both include the prompt's prefill; the table
also gives Ferry's time to first token and its decode rate after it. Outputs are compared
(as text: the streamed text against the decoded ``generate`` output). Writes
``ops/bench/results/stream_latency.json``. Usage:

    .venv/bin/python ops/bench/service/stream_latency.py  # 5 prompts x 128 tokens, 2 rounds
    .venv/bin/python ops/bench/service/stream_latency.py --quick    # 2 prompts x 64 tokens
    .venv/bin/python ops/bench/service/stream_latency.py --quick --threads 1  # both sides 1 thread
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from ops.bench.service import ferry_up  # noqa: E402
from worker.models import default_model_path  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "class LRUCache:\n    \"\"\"A least recently used cache.\"\"\"\n\n"
    "    def __init__(self, size):",
    "# Parse the command line arguments and",
    "def read_config(path):\n    with open(path) as f:",
]
RESULT = ROOT / "ops" / "bench" / "results" / "stream_latency.json"


def start_ferry(threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """``ferry up`` with one worker (the default model, this CPU's threads)."""
    env = dict(os.environ, FERRY_DEVICE="cpu", FERRY_TORCH_THREADS=str(threads))
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "stream-latency-up.log"
    return ferry_up.start_ferry(env, log)


def ferry_stream(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streaming completion; seconds to the last token, to the first, token count."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    chunks = 0
    text = ""
    with client.stream("POST", base + "/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text"):
                first = first or time.perf_counter()
                chunks += 1
                text += choice["text"]
    end = time.perf_counter()
    return {"seconds": end - t0, "ttft": (first or end) - t0, "chunks": chunks, "text": text}


def hf_load(threads: int) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as Ferry's requests
    model.generation_config.pad_token_id = 0
    return model, AutoTokenizer.from_pretrained(path)


@torch.inference_mode()
def hf_generate(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, use_cache=True)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "text": tokenizer.decode(out[0, ids.shape[1]:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of both sides (default: this CPU's count, as ferry up)")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    max_tokens = args.max_tokens or (64 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 2)
    threads = args.threads or os.cpu_count() or 1  # what ``ferry up`` gives its one worker
    model, tokenizer = hf_load(threads)
    proc, base = start_ferry(threads)
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client() as client:
            ferry_stream(client, base, prompts[0], 8)  # warm: first request's lazy setup
            hf_generate(model, tokenizer, prompts[0], 8)
            for rnd in range(rounds):  # interleaved, so both see the same machine load
                for prompt in prompts:
                    f = ferry_stream(client, base, prompt, max_tokens)
                    h = hf_generate(model, tokenizer, prompt, max_tokens)
                    rows.append({"round": rnd, "prompt": prompt[:30], "ferry_s": f["seconds"],
                                 "ferry_ttft_s": f["ttft"], "hf_s": h["seconds"],
                                 "same_text": f["text"] == h["text"]})
    finally:
        ferry_up.stop_ferry(proc)
    report(rows, max_tokens, threads, args.out)


def report(rows: list[dict[str, Any]], max_tokens: int, threads: int, out: str) -> None:
    print(f"{'prompt':32} {'ferry tok/s':>11} {'ttft ms':>8} {'decode tok/s':>12} "
          f"{'hf tok/s':>9} {'ratio':>6} same")
    for r in rows:
        f, h = max_tokens / r["ferry_s"], max_tokens / r["hf_s"]
        dec = (max_tokens - 1) / max(1e-9, r["ferry_s"] - r["ferry_ttft_s"])
        r.update(ferry_tok_s=f, hf_tok_s=h, ratio=f / h, ferry_decode_tok_s=dec)
        print(f"{r['prompt']!r:32} {f:11.1f} {1000 * r['ferry_ttft_s']:8.1f} {dec:12.1f} "
              f"{h:9.1f} {f / h:6.2f} {r['same_text']}")
    ferry = statistics.median(r["ferry_tok_s"] for r in rows)
    hf = statistics.median(r["hf_tok_s"] for r in rows)
    ratio = statistics.median(r["ratio"] for r in rows)
    print(f"median: ferry {ferry:.1f} tok/s, transformers generate {hf:.1f} tok/s, "
          f"ratio {ratio:.2f}x (target >= 1.5x)")
    summary = {"bench": "stream_latency", "max_tokens": max_tokens, "threads": threads,
               "ferry_tok_s_median": ferry, "hf_tok_s_median": hf, "ratio_median": ratio,
               "rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
