"""Grammar engines side by side: xgrammar and llguidance on the default model's tokenizer.

What decides the choice for Ferry's constrained sampler, measured in one run on one
machine: time to set up the tokenizer, time to compile a typical JSON schema (and a regex,
a choice list, an EBNF grammar), per-step mask time for a batch of 32 and 64 matchers
(filled in parallel, as the engine does), and behaviour on the default model (greedy and
seeded runs through transformers with each engine's mask: does the text parse and
validate, how many tokens). Prints a table and writes
``ops/bench/results/grammar_engines.json``. Usage:

    .venv/bin/pip install -e ".[bench]"   # xgrammar, for the comparison
    .venv/bin/python ops/bench/techniques/grammar_engines.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24}, "zip": {"type": "string",
                                                              "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= "SELECT " col (", " col)* " FROM " tbl\ncol ::= [a-z]+\ntbl ::= [a-z]+'
VOCAB = 8192


def _instances(n: int) -> list[str]:
    """Valid, varied documents for SCHEMA: the token paths the mask benchmark walks."""
    colors = ["red", "green", "blue"]
    return [json.dumps({"name": f"person {i}", "age": i % 90, "color": colors[i % 3],
                        "tags": [f"t{j}" for j in range(i % 4)],
                        "address": {"city": f"city {i * 7}", "zip": f"{10000 + i:05d}"}},
                       separators=(",", ":")) for i in range(n)]


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
        self.tokenizer_s = time.perf_counter() - start
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:
        comp = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json_schema":
            return comp.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                            separators=(",", ":"))
        if kind == "regex":
            return comp.compile_regex(spec)
        if kind == "choice":
            alts = " | ".join(json.dumps(c) for c in spec)
            return comp.compile_grammar(f"root ::= {alts}")
        return comp.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.tokenizer_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:
        llg = self.llg
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": False})
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(spec))
        else:
            grammar = llg.grammar_from("regex" if kind == "regex" else "ebnf", spec)
        matcher = llg.LLMatcher(self.tok, grammar)  # llguidance compiles lazily, per matcher
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
            bitmask.shape[1] * 4, bitmask.shape[0])

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compile_times(engine: Any, repeat: int) -> dict[str, float]:
    specs = {"json_schema": SCHEMA, "json_object": {"type": "object"}, "regex": REGEX,
             "choice": CHOICES, "ebnf": EBNF}
    out = {}
    for kind, spec in specs.items():
        k = "json_schema" if kind == "json_object" else kind
        out[kind] = round(_timed(lambda k=k, spec=spec: engine.compile(k, spec), repeat) * 1e3, 2)
    return out


def mask_times(engine: Any, tokenizer: Any, batch: int) -> dict[str, float]:
    """Walk `batch` matchers along valid documents; time each batched fill (ms per step)."""
    compiled = engine.compile("json_schema", SCHEMA)
    paths = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in _instances(batch)]
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    steps = min(len(p) for p in paths)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        engine.fill(matchers, bitmask)
        times.append(time.perf_counter() - start)
        for m, path in zip(matchers, paths, strict=True):
            allowed = (int(bitmask[matchers.index(m), path[step] // 32]) >> (path[step] % 32)) & 1
            assert allowed, f"{engine.name}: valid token masked out"
            assert engine.accept(m, path[step])
    return {"first_step_ms": round(times[0] * 1e3, 3),
            "median_step_ms": round(statistics.median(times) * 1e3, 3),
            "mean_step_ms": round(statistics.fmean(times) * 1e3, 3),
            "per_row_us": round(statistics.fmean(times) / batch * 1e6, 1)}


def on_model(engine: Any, model: Any, tokenizer: Any, runs: int) -> dict[str, Any]:
    """Generate with the engine's mask (greedy + seeded); count valid JSON and tokens."""
    import jsonschema

    compiled = engine.compile("json_schema", SCHEMA)
    prompt = tokenizer("# a person record as JSON\nperson = ", return_tensors="pt")["input_ids"]
    valid, lengths, seconds = 0, [], 0.0
    for run in range(runs):
        matcher = engine.matcher(compiled)
        bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        gen = torch.Generator().manual_seed(run)
        ids, out, past = prompt, [], None
        start = time.perf_counter()
        for _ in range(160):
            with torch.no_grad():
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            engine.fill([matcher], bitmask)
            bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
            logits = logits.masked_fill(bits.flatten()[:VOCAB] == 0, float("-inf"))
            if run == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token == tokenizer.eos_token_id:
                break
            assert engine.accept(matcher, token)
            out.append(token)
            ids = torch.tensor([[token]])
        seconds += time.perf_counter() - start
        lengths.append(len(out))
        try:
            jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"runs": runs, "valid": valid, "mean_tokens": round(statistics.fmean(lengths), 1),
            "s_per_run": round(seconds / runs, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models import default_model_path

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    results: dict[str, Any] = {}
    for cls in (Xgr, Llg):
        try:
            engine = cls(tokenizer, args.threads)
        except ImportError as exc:  # xgrammar is only in the "bench" extra
            print(f"skipping {cls.name}: {exc} (pip install -e '.[bench]')")
            continue
        results[engine.name] = {
            "tokenizer_setup_ms": round(engine.tokenizer_s * 1e3, 1),
            "compile_ms": compile_times(engine, 3 if args.quick else 7),
            "mask": {str(b): mask_times(engine, tokenizer, b) for b in (32, 64)},
            "model": on_model(engine, model, tokenizer, 4 if args.quick else 12),
        }
    _print(results)
    out = ROOT / "ops/bench/results/grammar_engines.json"
    machine = {"cpu": platform.machine(), "threads": args.threads, "torch": torch.__version__}
    out.write_text(json.dumps({"machine": machine, "quick": args.quick, **results}, indent=2)
                   + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def _print(results: dict[str, Any]) -> None:
    names = list(results)
    rows: list[tuple[str, ...]] = [("", *names)]
    rows.append(("tokenizer setup (ms)", *(str(results[n]["tokenizer_setup_ms"]) for n in names)))
    for kind in results[names[0]]["compile_ms"]:
        rows.append((f"compile {kind} (ms)", *(str(results[n]["compile_ms"][kind])
                                               for n in names)))
    for b in ("32", "64"):
        for key in ("first_step_ms", "median_step_ms", "per_row_us"):
            rows.append((f"batch {b} mask {key}", *(str(results[n]["mask"][b][key])
                                                    for n in names)))
    for key in ("valid", "runs", "mean_tokens", "s_per_run"):
        rows.append((f"default model {key}", *(str(results[n]["model"][key]) for n in names)))
    width = max(len(r[0]) for r in rows)
    for row in rows:
        print(row[0].ljust(width), *(c.rjust(12) for c in row[1:]))


if __name__ == "__main__":
    main()
