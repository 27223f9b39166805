#!/usr/bin/env bash
# Create .venv/ in the repo root and install Ferry with its dev extra.
# Idempotent: a second run with an unchanged pyproject.toml only checks and exits.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] installing redis-server"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  else
    echo "[setup] redis-server missing and apt-get unavailable: install Redis 7 by hand" >&2
    exit 1
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
STAMP="$VENV/.ferry-installed"
WANT="$(cat pyproject.toml ops/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[setup] .venv up to date"
  exit 0
fi

# torch first, pinned: this workplace's pip finds the CPU build of 2.13.0 on local disk
# (an unpinned torch would pull a multi-GB CUDA build).
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[dev]"
echo "$WANT" > "$STAMP"
echo "[setup] done: $VENV"
