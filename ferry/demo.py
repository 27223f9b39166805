"""``ferry up --demo``: a few prompts streamed through the gateway's OpenAI API, printed as
the tokens come, with nothing but the standard library (what a user's curl would see)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request

DEMO_PROMPTS = ["def fibonacci(n):", "The quick brown fox", "class Queue:"]


def stream_demo(url: str, max_tokens: int) -> None:
    """Stream each demo prompt; with ``FERRY_API_KEYS`` set, as the first key's tenant."""
    headers = {"Content-Type": "application/json"}
    keys = [k.strip() for k in os.environ.get("FERRY_API_KEYS", "").split(",") if k.strip()]
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    for prompt in DEMO_PROMPTS:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
        sys.stdout.write(f"\n>>> {prompt}")
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"demo request failed: {chunk['error']}")
                sys.stdout.write(chunk["choices"][0].get("text", ""))
                sys.stdout.flush()
        sys.stdout.write("\n")
