"""Tool calling against ``ferry up`` with the default model: the Done-when table of
issue 31 (docs/tools.md).

Rows (temperature 1 throughout, the official openai SDK as the client, 25 requests in
flight at a time):

* required / named: N requests alternating ``tool_choice="required"`` and a named
  function; a request passes when it returns at least one call and every call names an
  offered function with arguments that validate against its schema;
* auto: N requests with ``tool_choice="auto"``; a response passes when it is text with
  no call syntax in it, or valid calls (none malformed);
* streamed == whole: N seeded requests sent twice, streamed (the SDK's stream helper
  reassembles the calls) and not; passes when the calls (names, arguments) are equal;
* tools + response_format: N requests whose history already holds a call and its
  result; passes when the answer is valid calls or JSON that validates against the schema.

Prints a table and writes ``ops/bench/results/tools.json``. Usage:

    .venv/bin/python ops/bench/techniques/tools.py [--n 50] [--base-url http://127.0.0.1:8000]

Without ``--base-url`` it starts ``ferry up`` on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai

ROOT = Path(__file__).resolve().parents[3]
TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 100},
            "b": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
          "required": ["answer"], "additionalProperties": False}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
HISTORY: list[Any] = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
MAX_TOKENS = 300
CONCURRENCY = 25


def valid_calls(calls: Any) -> list[tuple[str, Any]] | None:
    """(name, arguments) of every call, or None if one is malformed."""
    out = []
    for call in calls or []:
        try:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS[call.function.name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return None
        if not call.id.startswith("call_"):
            return None
        out.append((call.function.name, args))
    return out


def each(n: int, one: Callable[[int], Any]) -> list[Any]:
    """``one(i)`` for i < n, ``CONCURRENCY`` at a time: the worker batches them."""
    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, range(n)))


def required_named(client: openai.OpenAI, n: int) -> int:
    def one(i: int) -> bool:
        choice: Any = "required" if i % 2 == 0 else {
            "type": "function", "function": {"name": ("add", "get_weather")[i // 2 % 2]}}
        out = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
            max_tokens=MAX_TOKENS)  # type: ignore[call-overload]
        calls = valid_calls(out.choices[0].message.tool_calls)
        named = isinstance(choice, dict) and calls is not None and any(
            name != choice["function"]["name"] for name, _ in calls)
        return bool(calls) and not named

    return sum(each(n, one))


def auto(client: openai.OpenAI, n: int) -> tuple[int, int, int]:
    """(well-formed, of which text, of which calls)."""
    def one(_: int) -> str:
        out = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=80)
        message = out.choices[0].message
        if message.tool_calls:
            return "calls" if valid_calls(message.tool_calls) is not None else "malformed"
        return "text" if "<tool_call>" not in (message.content or "") else "malformed"

    got = each(n, one)
    return n - got.count("malformed"), got.count("text"), got.count("calls")


def streamed_equal(client: openai.OpenAI, n: int) -> int:
    def one(seed: int) -> bool:
        body: dict[str, Any] = dict(model="default", messages=ASK, tools=TOOLS,
                                    tool_choice="required", temperature=1.0, seed=seed,
                                    max_tokens=MAX_TOKENS)
        whole = valid_calls(client.chat.completions.create(**body).choices[0]
                            .message.tool_calls)
        with client.chat.completions.stream(**body) as stream:
            for _ in stream:
                pass
            # the helper's own reassembly (get_final_completion refuses a length cut)
            snapshot = stream.current_completion_snapshot
        return whole is not None and valid_calls(snapshot.choices[0].message.tool_calls) == whole

    return sum(each(n, one))


def with_response_format(client: openai.OpenAI, n: int) -> tuple[int, int]:
    """(valid, of which JSON answers)."""
    def one(_: int) -> str:
        out = client.chat.completions.create(
            model="default", messages=HISTORY, tools=TOOLS, temperature=1.0, max_tokens=120,
            response_format={"type": "json_schema",  # type: ignore[typeddict-item]
                             "json_schema": {"name": "answer", "schema": ANSWER}})
        message = out.choices[0].message
        if message.tool_calls:
            return "calls" if valid_calls(message.tool_calls) is not None else "bad"
        try:
            jsonschema.validate(json.loads(message.content or ""), ANSWER)
        except (ValueError, jsonschema.ValidationError):
            return "bad"
        return "answer"

    got = each(n, one)
    return n - got.count("bad"), got.count("answer")


@contextlib.contextmanager
def ferry_up() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FERRY_DEVICE": os.environ.get("FERRY_DEVICE", "cpu"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "up", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("ferry up did not become healthy in 180 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--base-url", default=None)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.base_url or stack.enter_context(ferry_up())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                               timeout=600)
        started = time.time()
        rows = {"required/named: calls parse and validate": required_named(client, args.n)}
        well_formed, text, calls = auto(client, args.n)
        rows["auto: text or valid calls (none malformed)"] = well_formed
        rows["streamed == non-streamed (same seed)"] = streamed_equal(client, args.n)
        valid, answers = with_response_format(client, args.n)
        rows["tools + response_format: validates"] = valid
    print(f"{'check':<48} {'passed':>10}")
    for name, passed in rows.items():
        print(f"{name:<48} {passed:>6}/{args.n}")
    print(f"(auto: {text} text, {calls} calls; response_format: {answers} JSON answers, "
          f"{valid - answers} calls)")
    result = {"n": args.n, "temperature": 1.0, "model": "default", "rows": rows,
              "auto": {"text": text, "calls": calls},
              "response_format": {"json_answers": answers, "calls": valid - answers},
              "seconds": round(time.time() - started, 1)}
    out = ROOT / "ops" / "bench" / "results" / "tools.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
