"""``ferry up --lora NAME=PATH`` (and ``--enable-lora``, ``--max-loras``,
``--max-lora-rank``) become the ``FERRY_*`` variables the workers it starts read: the
engine's config built from them has LoRA on with those adapters. A malformed module is
refused before anything starts, not in every worker's crash loop."""

from __future__ import annotations

import pytest
import typer

from ferry.commands.lora_flags import lora_env
from worker.engine.config import EngineConfig


def test_modules_enable_lora_and_reach_the_engine_config() -> None:
    env = lora_env(["sql=/lora/sql", "chat=/lora/chat"], False, 2, 16)
    assert env == {"FERRY_LORA_MODULES": "sql=/lora/sql,chat=/lora/chat",
                   "FERRY_MAX_LORAS": "2", "FERRY_MAX_LORA_RANK": "16",
                   "FERRY_ENABLE_LORA": "1"}
    config = EngineConfig.from_env("some/model", env)
    assert config.lora is not None and config.lora.max_loras == 2
    assert config.lora.max_lora_rank == 16
    assert config.lora_modules == (("sql", "/lora/sql"), ("chat", "/lora/chat"))


def test_roots_reach_the_workers_and_the_gateway() -> None:
    env = lora_env(None, True, None, None, ["/lora", "/srv/adapters"])
    assert env["FERRY_LORA_ROOTS"] == "/lora,/srv/adapters"


def test_no_flags_set_nothing_and_enable_alone_turns_it_on() -> None:
    assert lora_env(None, False, None, None) == {}  # the workers' own FERRY_* stay
    assert lora_env(None, True, None, None) == {"FERRY_ENABLE_LORA": "1"}
    config = EngineConfig.from_env("some/model", {"FERRY_ENABLE_LORA": "1"})
    assert config.lora is not None and config.lora_modules == ()


@pytest.mark.parametrize("bad", ["sql", "=/lora/sql", "sql=", " = "])
def test_a_malformed_module_is_refused(bad: str) -> None:
    with pytest.raises(typer.BadParameter, match="NAME=PATH"):
        lora_env(["ok=/lora/ok", bad], False, None, None)
