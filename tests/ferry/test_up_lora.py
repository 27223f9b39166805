"""``ferry up --lora NAME=PATH`` (and ``--enable-lora``, ``--max-loras``,
``--max-lora-rank``, ``--lora-root``) become the ``ferry worker`` flags of the workers it
starts, and ``ferry worker`` builds the engine's config from those flags (the ``FERRY_*``
variables only where a flag is not given), writing nothing to the environment. A
malformed module is refused before anything starts, not in every worker's crash loop."""

from __future__ import annotations

import os
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import worker.service.main
from ferry.cli import app
from ferry.commands.lora_flags import gateway_lora_env, lora_args
from worker.engine.config import EngineConfig


def _worker_config(monkeypatch: pytest.MonkeyPatch, args: list[str],
                   env: dict[str, str] | None = None) -> EngineConfig:
    """The config ``ferry worker ARGS`` hands ``run_worker`` (which is not run)."""
    seen: dict[str, Any] = {}

    def run_worker(config: EngineConfig, settings: object, **_kw: object) -> int:
        seen["config"] = config
        return 0

    monkeypatch.setattr(worker.service.main, "run_worker", run_worker)
    for name in [k for k in os.environ if k.startswith("FERRY_")]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    result = CliRunner().invoke(app, ["worker", "--model", "some/model", *args])
    assert result.exit_code == 0, result.output
    assert dict(os.environ) == before  # nothing written for the config to read back
    return seen["config"]  # type: ignore[no-any-return]


def test_modules_enable_lora_and_reach_the_engine_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args = lora_args(["sql=/lora/sql", "chat=/lora/chat"], False, 2, 16)
    assert args == ["--lora", "sql=/lora/sql", "--lora", "chat=/lora/chat", "--enable-lora",
                    "--max-loras", "2", "--max-lora-rank", "16"]
    config = _worker_config(monkeypatch, args)
    assert config.lora is not None and config.lora.max_loras == 2
    assert config.lora.max_lora_rank == 16
    assert config.lora_modules == (("sql", "/lora/sql"), ("chat", "/lora/chat"))


def test_flags_win_over_the_variables_and_the_variables_fill_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = _worker_config(
        monkeypatch, ["--max-num-seqs", "5", "--speculative", "suffix"],
        {"FERRY_MAX_NUM_SEQS": "9", "FERRY_BLOCK_SIZE": "32", "FERRY_MAX_LORAS": "3"})
    assert config.scheduler.max_num_seqs == 5
    assert config.cache.block_size == 32
    assert config.speculative.method == "suffix"
    assert config.lora is not None and config.lora.max_loras == 3


def test_no_flags_leave_every_default_to_the_dataclasses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _worker_config(monkeypatch, []) == EngineConfig.create("some/model")


def test_roots_reach_the_workers_and_the_gateway() -> None:
    args = lora_args(None, True, None, None, ["/lora", "/srv/adapters"])
    assert args == ["--enable-lora", "--lora-roots", "/lora,/srv/adapters"]
    assert gateway_lora_env(["/lora", "/srv/adapters"]) == {
        "FERRY_LORA_ROOTS": "/lora,/srv/adapters"}


def test_no_flags_set_nothing_and_enable_alone_turns_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert lora_args(None, False, None, None) == []  # the workers' own FERRY_* stay
    assert gateway_lora_env(None) == {}
    config = _worker_config(monkeypatch, lora_args(None, True, None, None))
    assert config.lora is not None and config.lora_modules == ()


@pytest.mark.parametrize("bad", ["sql", "=/lora/sql", "sql=", " = "])
def test_a_malformed_module_is_refused(bad: str) -> None:
    with pytest.raises(typer.BadParameter, match="NAME=PATH"):
        lora_args(["ok=/lora/ok", bad], False, None, None)
