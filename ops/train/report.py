"""Measure the shipped default model and write its model card.

Run from the repository root after ``train_default.py`` (which calls it at the end)::

    OMP_NUM_THREADS=1 .venv/bin/python ops/train/report.py

It scores the *saved* bf16 weights, not the fp32 training copy, so the figures in
``docs/model.md`` describe exactly what ships: held-out bits per byte beside ``gzip -9`` on
the same files, greedy samples, the loss curve (``docs/model-loss.png``) and the sha256 of
``model.safetensors`` that ``tests/worker/test_default_model.py`` checks against.
"""

from __future__ import annotations

import os

# The same one-thread caps as training, set before torch/tokenizers start their pools.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import train_default  # noqa: E402
from data import (  # noqa: E402
    HELDOUT_EVERY,
    HELDOUT_OFFSET,
    encode_stream,
    gzip_bits_per_byte,
    load_corpus,
)
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("def ", "class ", "import ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Paths default to the shipped locations; ``--train-seconds`` is the run's wall time."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=train_default.DEFAULT_OUT)
    p.add_argument("--log", type=Path, default=train_default.DEFAULT_LOG)
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "model.md")
    p.add_argument("--png", type=Path, default=REPO / "docs" / "model-loss.png")
    p.add_argument("--metrics", type=Path, default=REPO / "ops" / "train" / "metrics.json")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--train-seconds", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=48)
    return p.parse_args(argv)


@torch.no_grad()
def stream_bits(model: PreTrainedModel, ids: list[int], seq_len: int, stride: int) -> float:
    """Total cross-entropy in bits of ``ids[1:]`` given everything before, using sliding
    ``seq_len`` windows that advance by ``stride``: every token is scored exactly once, with
    at least ``seq_len - stride`` tokens of context (except near the very start)."""
    data = torch.tensor(ids, dtype=torch.long)
    total_nats, scored = 0.0, 0  # scored = number of targets ids[1..scored] done so far
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + seq_len, len(ids) - 1)
        logits = model(input_ids=data[begin:end].unsqueeze(0)).logits[0].float()
        targets = data[begin + 1 : end + 1]
        fresh = end - scored  # targets not yet scored by an earlier window
        loss = torch.nn.functional.cross_entropy(logits[-fresh:], targets[-fresh:],
                                                 reduction="sum")
        total_nats += float(loss)
        scored = end
        if end == len(ids) - 1:
            break
    return total_nats / math.log(2)


def greedy_samples(model: PreTrainedModel, model_dir: Path, max_new: int) -> dict[str, str]:
    """Greedy continuations of the standard prompts (prompt included, BOS stripped)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = {}
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new)
        out[prompt] = tok.decode(ids[0], skip_special_tokens=True)
    return out


def read_log(path: Path) -> list[dict[str, str]]:
    """The training log rows written by ``train_default.train``."""
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def plot(rows: list[dict[str, str]], png: Path, bpb: float, gz: float) -> None:
    """Train (mean over each logging interval) and held-out loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(int(r["tokens"]) / 1e6, float(r["train_loss"])) for r in rows if r["train_loss"]]
    ho = [(int(r["tokens"]) / 1e6, float(r["heldout_loss"])) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*tr, strict=True), label="train (interval mean)")
    ax.plot(*zip(*ho, strict=True), label="held-out stdlib files", marker=".")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(0, min(9.5, max(v for _, v in ho) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Ferry default model: held-out {bpb:.3f} bits/byte (gzip -9: {gz:.3f})")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def measure(args: argparse.Namespace) -> dict:
    """All figures for the card, as one JSON-able dict."""
    corpus = load_corpus()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    ids = encode_stream(tok, corpus.heldout_texts)
    raw_bytes = sum(len(t.encode("utf-8")) for t in corpus.heldout_texts)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.bfloat16)
    model.float().eval()  # bf16 weights upcast exactly; fp32 maths for a stable figure
    bits = stream_bits(model, ids, args.seq_len, args.stride)
    gz_file, gz_concat = gzip_bits_per_byte(corpus.heldout_texts)
    rows = read_log(args.log)
    cfg = json.loads((args.model / "config.json").read_text())
    return {
        "heldout_bits_per_byte": bits / raw_bytes,
        "heldout_bits_per_token": bits / (len(ids) - 1),
        "heldout_bytes": raw_bytes,
        "heldout_tokens": len(ids) - 1,
        "gzip9_bits_per_byte_per_file": gz_file,
        "gzip9_bits_per_byte_concat": gz_concat,
        "heldout_files": corpus.heldout_paths,
        "train_files": len(corpus.train_paths),
        "train_bytes": sum(len(t.encode("utf-8")) for t in corpus.train_texts),
        "train_stream_tokens": len(encode_stream(tok, corpus.train_texts)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": cfg,
        "steps": int(rows[-1]["step"]),
        "tokens_seen": int(rows[-1]["tokens"]),
        "train_loop_seconds": float(rows[-1]["elapsed_s"]),
        "train_seconds": args.train_seconds,
        "final_train_loss": float(rows[-1]["train_loss"]),
        "final_heldout_loss_subset": float(rows[-1]["heldout_loss"]),
        "samples": greedy_samples(model, args.model, args.max_new_tokens),
        "safetensors_sha256": sha256(args.model / "model.safetensors"),
        "folder_bytes": sum(f.stat().st_size for f in args.model.iterdir() if f.is_file()),
        "heldout_rule": f"index % {HELDOUT_EVERY} == {HELDOUT_OFFSET}",
        "eval": {"seq_len": args.seq_len, "stride": args.stride},
        "python": corpus.root.name,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure, plot, and write ``metrics.json`` and the model card."""
    import model_card

    torch.set_num_threads(1)
    args = parse_args(argv)
    m = measure(args)
    if m["train_seconds"] is None and args.metrics.exists():
        m["train_seconds"] = json.loads(args.metrics.read_text()).get("train_seconds")
    args.metrics.write_text(json.dumps(m, indent=2) + "\n")
    plot(read_log(args.log), args.png, m["heldout_bits_per_byte"],
         m["gzip9_bits_per_byte_per_file"])
    args.doc.write_text(model_card.render(m, train_default.parse_args([])))
    print(json.dumps({k: v for k, v in m.items() if k not in ("config", "heldout_files")},
                     indent=2))


if __name__ == "__main__":
    main()
