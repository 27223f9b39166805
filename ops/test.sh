#!/usr/bin/env bash
# The test command: installs what it needs (.venv, packages, redis-server), then runs
# ruff, mypy and the whole pytest suite on the CPU (Triton kernels under the interpreter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ops/setup.sh
export TRITON_INTERPRET=1 PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
