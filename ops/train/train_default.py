"""Train Ferry's embedded default model: a small Llama on the Python standard library.

Run from the repository root (~45 minutes on one core, report included)::

    OMP_NUM_THREADS=1 .venv/bin/python ops/train/train_default.py

It trains a byte-level BPE tokenizer and a Llama-architecture causal LM on the running
interpreter's stdlib sources, holding out every 20th file, saves both in Hugging Face format
(bf16 safetensors) into ``worker/models/default/`` and then runs ``report.py`` to measure the
shipped weights and write ``docs/model.md`` and ``docs/model-loss.png``.

It uses exactly one CPU thread (the machines it is meant for share their other cores), a
fixed seed and a fixed number of steps rather than a time budget, so a rerun on the same
interpreter reproduces the same data, tokenizer and schedule.
"""

from __future__ import annotations

import os

# Thread caps must be in place before torch/tokenizers spin up their pools.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from data import CHAT_TEMPLATE, EOS, encode_stream, load_corpus, train_tokenizer  # noqa: E402
from tokenizers import Tokenizer, processors  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "worker" / "models" / "default"
DEFAULT_LOG = REPO / "ops" / "train" / "loss.csv"
MAX_POSITIONS = 2048  # RoPE: usable beyond the 256-token training windows, with degradation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Hyper-parameters; the defaults are the shipped model's (sized for ~40 min on 1 core)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--log", type=Path, default=DEFAULT_LOG)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=1150)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slower)")
    p.add_argument("--no-report", action="store_true", help="skip report.py at the end")
    return p.parse_args(argv)


def save_tokenizer(tok: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    """Wrap the raw tokenizer for ``AutoTokenizer`` and write it next to the weights.

    The post-processor prepends ``EOS`` (which doubles as BOS): training documents all start
    right after an ``EOS``, so a prompt encoded with special tokens matches that context.
    ``save_jinja_files=False`` keeps the chat template inside ``tokenizer_config.json``,
    where older transformers releases also find it.
    """
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B:1", special_tokens=[(EOS, eos_id)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out), save_jinja_files=False)
    # transformers 5 writes its own class name; the 4.x name loads in both major versions.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return fast


def build_model(args: argparse.Namespace, eos_id: int) -> LlamaForCausalLM:
    """A small Llama with tied embeddings (the embedding table is a third of the weights)."""
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def batches(
    stream: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless ``[batch, seq_len + 1]`` windows: each epoch is a shuffled, randomly shifted
    tiling of the stream, so every training token is seen once per epoch."""
    while True:
        shift = int(torch.randint(0, seq_len, (1,), generator=gen))
        starts = torch.arange(shift, len(stream) - seq_len - 1, seq_len)
        order = starts[torch.randperm(len(starts), generator=gen)]
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield torch.stack([stream[s : s + seq_len + 1] for s in order[i : i + batch_size]])


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.min_lr_ratio
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token loss (nats) on a fixed slice of held-out windows, for the curve."""
    model.eval()
    total = 0.0
    for chunk in windows.split(16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        )
        total += float(loss)
    model.train()
    return total / windows[:, 1:].numel()


def make_step(
    model: LlamaForCausalLM, opt: torch.optim.Optimizer, compile_model: bool
) -> Callable[[torch.Tensor], float]:
    """One optimiser step on a batch; the forward is compiled (≈1.5x on one CPU core)."""

    def forward(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten()
        )

    fwd = torch.compile(forward) if compile_model else forward

    def step(batch: torch.Tensor) -> float:
        loss = fwd(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def train(args: argparse.Namespace, model: LlamaForCausalLM, train_ids: torch.Tensor,
          eval_windows: torch.Tensor) -> None:
    """The training loop; appends one CSV row per ``eval_every`` steps to ``args.log``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    step_fn = make_step(model, opt, not args.no_compile)
    gen = torch.Generator().manual_seed(args.seed)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    fields = ["step", "tokens", "lr", "train_loss", "heldout_loss", "elapsed_s"]
    with args.log.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerow({"step": 0, "tokens": 0, "lr": 0.0, "train_loss": "",
                         "heldout_loss": f"{heldout_loss(model, eval_windows):.4f}",
                         "elapsed_s": 0.0})
        start, window = time.time(), []
        for step, batch in zip(range(args.steps), batches(train_ids, args.seq_len,
                                                           args.batch_size, gen), strict=False):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            window.append(step_fn(batch))
            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                row = {"step": done, "tokens": done * args.batch_size * args.seq_len,
                       "lr": f"{lr_at(step, args):.6f}",
                       "train_loss": f"{sum(window) / len(window):.4f}",
                       "heldout_loss": f"{heldout_loss(model, eval_windows):.4f}",
                       "elapsed_s": f"{time.time() - start:.1f}"}
                writer.writerow(row)
                fh.flush()
                print(row, flush=True)
                window = []


def main() -> None:
    """Data → tokenizer → model → train → save (bf16) → report."""
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.time()
    corpus = load_corpus()
    print(f"corpus: {len(corpus.train_paths)} train files, {len(corpus.heldout_paths)} held out",
          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus.train_texts, args.vocab_size)
    fast = save_tokenizer(tok, args.out)
    eos_id = fast.eos_token_id
    train_ids = torch.tensor(encode_stream(tok, corpus.train_texts), dtype=torch.long)
    held_ids = torch.tensor(encode_stream(tok, corpus.heldout_texts), dtype=torch.long)
    n_eval = min(args.eval_windows, (len(held_ids) - 1) // args.seq_len)
    eval_windows = torch.stack([held_ids[i * args.seq_len : (i + 1) * args.seq_len + 1]
                                for i in range(n_eval)])
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)} ({time.time() - t0:.0f}s)",
          flush=True)
    model = build_model(args, eos_id)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    train(args, model, train_ids, eval_windows)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.to(torch.bfloat16).save_pretrained(str(args.out), safe_serialization=True)
    print(f"saved to {args.out} after {time.time() - t0:.0f}s", flush=True)
    if not args.no_report:
        import report

        report.main([f"--model={args.out}", f"--log={args.log}",
                     f"--train-seconds={time.time() - t0:.0f}", f"--seq-len={args.seq_len}"])


if __name__ == "__main__":
    main()
