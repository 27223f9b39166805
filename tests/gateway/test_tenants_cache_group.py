"""A tenants file's ``prefix_cache_group``: the operator's opt-in to share a prefix-cache
space between tenants; bad values stop the file naming the field, and the gateway names
the group on every request of its tenants (a caller cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tenancy.principal import scoped
from gateway.tenancy.tenants import TenantDirectory, key_sha256
from protocol.models import GenerateRequest


def _file(tmp_path: Path, group: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.t]\nkeys_sha256 = ["{key_sha256("k")}"]\n'
                    f"prefix_cache_group = {group}\n"
                    f'[tenants.u]\nkeys_sha256 = ["{key_sha256("j")}"]\n')
    return path


def test_group_is_read_and_named_on_the_tenants_requests(tmp_path: Path) -> None:
    directory = TenantDirectory.from_file(_file(tmp_path, '"public"'))
    grouped, alone = directory.resolve("k"), directory.resolve("j")
    assert grouped is not None and grouped.prefix_cache_group == "public"
    assert alone is not None and alone.prefix_cache_group is None
    plain = GenerateRequest(request_id="r", prompt="x")
    [mine] = scoped(grouped, [plain])
    assert (mine.tenant, mine.cache_scope, mine.request_id) == ("t", "public", "t::r")
    [theirs] = scoped(alone, [plain.model_copy(update={"cache_scope": "public"})])
    assert theirs.cache_scope is None  # only the gateway's directory names a group


@pytest.mark.parametrize("value", ['""', '"a b"', '"g::x"', "1", '["public"]', f'"{"g" * 41}"'])
def test_bad_group_stops_the_file(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match="tenants.t.prefix_cache_group"):
        TenantDirectory.from_file(_file(tmp_path, value))
