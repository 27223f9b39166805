"""The protocol and the gateway must stay importable without torch or transformers.

A gateway pod should start in a second on a small CPU image, and any Python service should
be able to enqueue jobs without a multi-GB dependency; checked in a fresh interpreter
because this test process may well have torch loaded by other tests.
"""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "protocol", "protocol.client", "protocol.aclient", "protocol.store", "protocol.codec",
    "gateway", "gateway.app", "gateway.main",
]

PROBE = f"""
import sys
for name in {MODULES!r}:
    __import__(name)
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
print(','.join(heavy))
"""


def test_protocol_and_gateway_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"
