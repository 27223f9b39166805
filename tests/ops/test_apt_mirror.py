"""The base-image script takes its Debian mirror from this machine's apt sources, never
from a host name written in the repo (``ops/docker/apt-mirror.sh``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "docker" / "apt-mirror.sh"

DEB822 = """\
Types: deb
# a comment line inside a stanza
URIs: http://mirror.example.test/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example.test/debian
Suites: bookworm

Types: deb
URIs: http://off.example.test/debian
Suites: bookworm
Enabled: no

Types: deb
URIs: http://mirror.example.test/debian/
Suites: bookworm bookworm-updates
Components: main
"""


def _mirror(etc: Path, suite: str = "bookworm") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), suite], env={"APT_ETC": str(etc),
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)


def _etc(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_deb822_sources_pick_the_enabled_deb_entry_serving_the_suite(tmp_path: Path) -> None:
    etc = _etc(tmp_path, {"sources.list.d/debian.sources": DEB822})
    done = _mirror(etc)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "http://mirror.example.test/debian"


def test_one_line_sources_list(tmp_path: Path) -> None:
    etc = _etc(tmp_path, {"sources.list": (
        "# deb http://commented.example.test/debian bookworm main\n"
        "deb-src http://src.example.test/debian bookworm main\n"
        "deb [signed-by=/k.gpg arch=amd64] http://list.example.test/debian bookworm main\n")})
    assert _mirror(etc).stdout.strip() == "http://list.example.test/debian"


def test_a_debian_mirror_of_other_suites_is_the_fallback(tmp_path: Path) -> None:
    etc = _etc(tmp_path, {"sources.list.d/x.list":
                          "deb http://other.example.test/debian trixie main\n"})
    assert _mirror(etc).stdout.strip() == "http://other.example.test/debian"


def test_no_debian_mirror_is_a_clear_error(tmp_path: Path) -> None:
    etc = _etc(tmp_path, {"sources.list.d/x.sources": (
        "Types: deb\nURIs: http://sec.example.test/debian-security\n"
        "Suites: bookworm-security\n")})
    done = _mirror(etc)
    assert done.returncode == 1
    assert "set DEBIAN_MIRROR" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("name", ["local-base-images.sh", "apt-mirror.sh"])
def test_no_mirror_host_is_written_in_the_scripts(name: str) -> None:
    text = (ROOT / "ops" / "docker" / name).read_text()
    assert not re.search(r"https?://", text), f"{name} names a host"
