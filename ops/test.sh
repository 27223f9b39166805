#!/usr/bin/env bash
# The test command: installs what it needs (.venv, packages, redis-server), then runs
# ruff, mypy and the whole pytest suite on the CPU (Triton kernels under the interpreter),
# then, for the whole suite (no pytest arguments), the compose smoke test
# (ops/compose-smoke.sh: the real docker-compose.yml, built and run on loopback; it
# installs and starts Docker where it can, and is skipped with exit 77, said plainly, only
# where Docker cannot run at all).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ops/setup.sh
export TRITON_INTERPRET=1 PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ "$#" -gt 0 ]; then
  echo "compose-smoke: not run (pytest arguments given: a partial run)"
else
  code=0
  bash ops/compose-smoke.sh || code=$?
  if [ "$code" -eq 77 ]; then
    echo "compose-smoke: skipped: Docker cannot run on this machine (see above)"
  elif [ "$code" -ne 0 ]; then
    exit "$code"
  fi
fi
