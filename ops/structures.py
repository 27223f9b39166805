"""Regenerate the module map of ``docs/structures.md`` from the modules' own docstrings.

    python ops/structures.py          # rewrite the map, keep the lifecycle sections
    python ops/structures.py --check  # exit 1 if the file is out of date (the test does this)

One line per module: its docstring's first sentence. The sections below the map (from
``## Request lifecycle`` on) are hand-written and kept as they are. Why generated: a map
written by hand drifted every time a module moved; the docstrings move with the code.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "structures.md"
LIFECYCLE_MARK = "## Request lifecycle"

# (folder, heading caption); each section lists that folder's modules (not sub-folders)
SECTIONS = [
    ("protocol", "torch-free wire contract"),
    ("protocol/models", "the wire messages: vocabulary, requests, results"),
    ("protocol/tenants", "tenants on the wire: ids, the cache partition, the fair backlog"),
    ("protocol/affinity", "prefix affinity: chunk hashes, workers' boards, preference marks"),
    ("protocol/structured", "structured output and tool calls on the wire"),
    ("protocol/lora", "the LoRA registry and adapter paths"),
    ("protocol/batch", "the Batch API's records and commands"),
    ("protocol/cluster", "Redis Cluster and pub/sub plumbing"),
    ("gateway", "FastAPI, no torch: the app, its settings and its queue client"),
    ("gateway/metrics", "Prometheus: the gateway's series and the fleet's vLLM view"),
    ("gateway/served", "the base models and LoRA adapters this gateway serves"),
    ("gateway/openai_api", "OpenAI's request and response shapes"),
    ("gateway/tenancy", "API keys, tenants, quotas"),
    ("gateway/routes", "the HTTP routes, one module per API"),
    ("gateway/batcher", "the Batch API's driver, ``ferry batcher``: a process of its own"),
    ("worker", "the worker package: lazy exports"),
    ("worker/engine", "the inference engine: one step, no I/O"),
    ("worker/engine/sched", "the scheduler: what runs each step"),
    ("worker/engine/kv", "the KV cache's bookkeeping, prefix cache and host tier"),
    ("worker/engine/runner", "the model, its inputs and its forward"),
    ("worker/engine/runner/attention", "paged attention and its backends"),
    ("worker/engine/runner/cpu", "the lean CPU path"),
    ("worker/engine/runner/quant", "quantized weights: FP8 W8A8, INT8 and INT4 weight-only"),
    ("worker/engine/distributed", "tensor parallelism: the group, the shards, the layers"),
    ("worker/engine/sample", "sampling a step's logits"),
    ("worker/engine/structured", "constrained decoding"),
    ("worker/engine/inputs", "prompts in"),
    ("worker/engine/output", "torch-free: a step's ids out, and text"),
    ("worker/engine/speculative", "suffix decoding: drafts with no draft model"),
    ("worker/engine/lora", "multi-LoRA: many adapters over one base model in one batch"),
    ("worker/service", "the Redis worker process around the engine"),
    ("worker/service/intake", "stream entries -> admissions"),
    ("worker/service/affinity", "what this worker's prefix cache holds, on its board"),
    ("worker/service/outbox", "events -> Redis"),
    ("worker/service/output_proc", "the output process"),
    ("worker/service/redis", "connections, leases, shards"),
    ("worker/service/sidecars", "threads beside the engine loop"),
    ("worker/service/metrics", "Prometheus and heartbeat stats"),
    ("worker/models", "models shipped as package data"),
    ("kernels", "Triton kernels, the C++ CPU kernel, their pure-torch twins"),
    ("kernels/moe", "mixture of experts: the fused Triton kernel, the grouped CPU path"),
    ("kernels/quant", "quantized weights: the C++ INT8 CPU kernel, Triton W8A16/W4A16"),
    ("observability", "logging and vLLM's metric names, shared by every process"),
    ("ferry", "the CLI, on top of everything"),
    ("ferry/commands", "one module per subcommand"),
]
EXTRA = {
    "kernels": ["- `kernels/csrc/int8_linear_cpu.cpp` — The C++ INT8 weight-only linear "
                "kernel (fp32 activations, weights widened in registers, 4x4 register "
                "tiles, OpenMP over output rows).",
                "- `kernels/csrc/paged_decode_cpu.cpp` — The C++ CPU paged decode kernel "
                "(online softmax per page, next page prefetched, OpenMP per sequence)."],
    "worker/models": ["- `worker/models/default/` — the embedded default model (Hugging Face "
                      "format; see docs/model.md)."],
}


def first_sentence(path: Path) -> str:
    """The docstring's first sentence, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    if not paragraph:
        raise SystemExit(f"{path.relative_to(ROOT)}: no module docstring")
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    return match.group(1) if match else paragraph + "."


def module_map() -> str:
    lines = ["# Structures", "",
             "One line per module, generated from the module docstrings by "
             "`python ops/structures.py`; the lifecycle sections below are written by hand."]
    for folder, caption in SECTIONS:
        lines += ["", f"## {folder}/ ({caption})"]
        for path in sorted((ROOT / folder).glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines.append(f"- `{rel}` — {first_sentence(path)}")
        lines += EXTRA.get(folder, [])
    return "\n".join(lines) + "\n\n"


def render() -> str:
    text = DOC.read_text()
    at = text.find(LIFECYCLE_MARK)
    if at < 0:
        raise SystemExit(f"{DOC}: no '{LIFECYCLE_MARK}' section to keep")
    return module_map() + text[at:]


def main() -> int:
    wanted = render()
    if "--check" in sys.argv[1:]:
        if DOC.read_text() != wanted:
            print(f"{DOC.relative_to(ROOT)} is out of date: run python ops/structures.py")
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
