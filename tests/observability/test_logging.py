"""observability.logging: JSON lines in containers, context ids on every line, prompts redacted."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from observability.logging import configure_logging, redact_prompt


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test configures logging onto its captured stdout; undo it afterwards."""
    monkeypatch.delenv("FERRY_LOG_JSON", raising=False)
    monkeypatch.delenv("FERRY_LOG_PROMPTS", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_carry_bound_context(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    structlog.contextvars.bind_contextvars(worker_id="gpu-0")
    log = structlog.get_logger("ferry.worker").bind(request_id="req-1")
    log.info("request_started", queued_s=0.25)
    structlog.get_logger("ferry.worker").warning("no_request_bound")
    lines = _json_lines(capsys.readouterr().out)
    assert lines[0]["event"] == "request_started" and lines[0]["queued_s"] == 0.25
    assert lines[0]["worker_id"] == "gpu-0" and lines[0]["request_id"] == "req-1"
    assert lines[0]["level"] == "info" and lines[0]["logger"] == "ferry.worker"
    assert str(lines[0]["timestamp"]).endswith("Z")
    assert lines[1]["worker_id"] == "gpu-0" and "request_id" not in lines[1]


def test_stdlib_and_uvicorn_records_use_the_same_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logging.getLogger("uvicorn.error").addHandler(logging.StreamHandler())  # as uvicorn does
    configure_logging(json_logs=True)
    structlog.contextvars.bind_contextvars(worker_id="gpu-1")
    logging.getLogger("uvicorn.error").warning("Started server process [%d]", 42)
    lines = _json_lines(capsys.readouterr().out)
    assert len(lines) == 1  # uvicorn's own handler was removed: no duplicate line
    assert lines[0]["event"] == "Started server process [42]"
    assert lines[0]["logger"] == "uvicorn.error" and lines[0]["worker_id"] == "gpu-1"


def test_level_filters_and_exceptions_are_rendered(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True, level="warning")
    log = structlog.get_logger("x")
    log.info("hidden")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    (line,) = _json_lines(capsys.readouterr().out)
    assert line["event"] == "failed" and "ValueError: boom" in str(line["exception"])
    with pytest.raises(ValueError, match="log level"):
        configure_logging(level="loud")


def test_console_format_in_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=False)
    structlog.get_logger("x").info("hello", request_id="r-9")
    out = capsys.readouterr().out
    assert "hello" in out and "request_id=r-9" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_format_follows_env_then_tty(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    configure_logging()  # captured stdout is not a TTY: JSON, as in a container
    structlog.get_logger("x").info("auto")
    assert _json_lines(capsys.readouterr().out)[0]["event"] == "auto"
    monkeypatch.setenv("FERRY_LOG_JSON", "0")
    configure_logging()
    structlog.get_logger("x").info("forced_console")
    assert not capsys.readouterr().out.lstrip().startswith("{")


def test_prompts_are_redacted_unless_allowed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert redact_prompt("my secret prompt") == "<redacted 16 chars>"
    assert redact_prompt([{"role": "user"}]) == "<redacted 1 items>"
    configure_logging(json_logs=True)
    structlog.get_logger("x").info("got", prompt="secret text", messages=[{"c": "x"}])
    line = _json_lines(capsys.readouterr().out)[0]
    assert line["prompt"] == "<redacted 11 chars>" and line["messages"] == "<redacted 1 items>"
    monkeypatch.setenv("FERRY_LOG_PROMPTS", "1")
    assert redact_prompt("visible") == "visible"
    structlog.get_logger("x").info("got", prompt="visible now")
    assert _json_lines(capsys.readouterr().out)[0]["prompt"] == "visible now"
