"""Batch input lines as units: what is a request, what is a blank, and the error code of
each way a line can fail to be one (the HTTP-level behaviour is in test_batches_api.py)."""

from __future__ import annotations

import json

import pytest

from gateway.batcher.lines import BadLine, bad_line_result, custom_id_of, parse_line
from gateway.errors import APIError

URL = "/v1/completions"


def _raw(**fields: object) -> bytes:
    line = {"custom_id": "a", "method": "POST", "url": URL, "body": {"prompt": "x"}}
    line.update(fields)
    return json.dumps({k: v for k, v in line.items() if v is not ...}).encode()


def test_a_request_and_blank_lines() -> None:
    parsed = parse_line(_raw() + b"\r\n", 4, URL, 1024)
    assert parsed is not None and (parsed.index, parsed.custom_id) == (4, "a")
    assert parsed.body == {"prompt": "x"}
    assert parse_line(b"  \r\n", 0, URL, 1024) is None


@pytest.mark.parametrize(("raw", "code"), [
    (b"{not json", "invalid_json_line"),
    (b"\xff\xfe", "invalid_json_line"),
    (b"[1, 2]", "invalid_json_line"),
    (_raw(custom_id=...), "invalid_custom_id"),
    (_raw(custom_id=7), "invalid_custom_id"),
    (_raw(custom_id=""), "invalid_custom_id"),
    (_raw(custom_id="x" * 513), "invalid_custom_id"),
    (_raw(method="GET"), "invalid_method"),
    (_raw(url="/v1/chat/completions"), "invalid_url"),
    (_raw(url=...), "invalid_url"),
    (_raw(body="prompt"), "invalid_body"),
    (_raw(body=...), "invalid_body"),
    (_raw(body={"prompt": "x" * 2000}), "request_too_large"),
])
def test_each_bad_line_has_its_code(raw: bytes, code: str) -> None:
    with pytest.raises(BadLine) as caught:
        parse_line(raw, 2, URL, 1024)
    assert caught.value.code == code and caught.value.message.startswith("line 3: ")


def test_error_lines_keep_what_can_be_known() -> None:
    assert custom_id_of(_raw(url="/elsewhere")) == "a"
    assert custom_id_of(b"{not json") is None and custom_id_of(b"[1]") is None
    result = bad_line_result("batch_0123456789ab", 3, None, "invalid_json_line", "line 4: x")
    assert not result.ok and json.loads(result.line) == {
        "id": "batch_req_0123456789ab-3", "custom_id": None, "response": None,
        "error": {"code": "invalid_json_line", "message": "line 4: x"}}


def test_a_lease_shorter_than_four_polls_is_refused() -> None:
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    with pytest.raises(ValidationError, match="batch_lease_s"):
        GatewaySettings(batch_lease_s=0.5, batch_poll_interval_s=0.25)
    assert GatewaySettings(batch_lease_s=1.0, batch_poll_interval_s=0.25).batch_lease_s == 1.0


def test_a_line_too_deep_to_parse_keeps_its_custom_id() -> None:
    """Only a key of the line itself counts, not one in its body or inside a string."""
    deep = "[" * 5000 + "]" * 5000
    decoys = '"body": {"custom_id": "inner", "x": "\\"custom_id\\": \\"s\\"", "y": ' + deep
    assert custom_id_of(f'{{{decoys}}}, "custom_id": "mine"}}'.encode()) == "mine"
    assert custom_id_of(f'{{{decoys}}}}}'.encode()) is None
    with pytest.raises(APIError, match=r"^body: nested too deep \(5001 levels"):
        parse_line(_raw(body={"prompt": "x", "stop": "@"}).replace(b'"@"', deep.encode()), 0,
                   URL, 1 << 20)
