#!/usr/bin/env bash
# One device call for #33, in priority order, inside a deadline (a lease is short): the
# correctness checks and the kernel tests side by side, then the timed runs one at a time.
#   carry [".device"];  command: bash ops/bench/gpu_session.sh [SECONDS [short]]  (540)
# short: the kernel tests, Llama's correctness in bf16 and fp32, Ferry's 1B row and profile.
# Writes under $OUT: session.log, kernels.log, correctness.json, engine.json, host_step.json, service.json.
set -u
. .device/env.sh || exit 1
O=${OUT:-/tmp/ferry-gpu}; mkdir -p "$O"
END=$(( $(date +%s) + ${1:-540} ))
SHORT=$([ "${2:-}" = short ] && echo 1)
exec > >(tee -a "$O/session.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc; free -g | head -2

# step NAME SECONDS CMD...: runs CMD with at most SECONDS, never past the deadline
step() {
  local name=$1 want=$2; shift 2
  local left=$(( END - $(date +%s) - 5 ))
  (( left < 20 )) && { echo "=== $name: skipped, ${left}s left"; return; }
  (( want > left )) && want=$left
  echo "=== $name (limit ${want}s) $(date +%T)"
  timeout "$want" "$@"; echo "=== $name rc=$? $(date +%T)"
}

# 1. correctness: kernels compiled for the GPU, and the fast engine path against eager
(step kernels 200 python3 -m pytest -q -p no:cacheprovider -n 6 tests/kernels \
   > "$O/kernels.log" 2>&1) &
KERNELS=$!
if [ -n "$SHORT" ]; then
  step correctness 120 python3 ops/bench/engine/gpu_correctness.py --archs llama \
    --dtypes auto float32 --out "$O/correctness.json"
else
  step correctness 200 python3 ops/bench/engine/gpu_correctness.py --dtypes auto float32 \
    --out "$O/correctness.json"
fi
wait "$KERNELS"  # a bare wait would also wait for the tee above: forever
tail -25 "$O/kernels.log"
# 2. the engine on the GPU, 1B mixed-gpu beside transformers, with the decode-step profile
if [ -n "$SHORT" ]; then
  step engine-1b 150 python3 ops/bench/engine/engine.py --device cuda --model-size 1b --profile \
    --workload mixed-gpu --skip variants hf --out "$O/engine.json"
  echo "=== done $(date +%T)"; exit 0
fi
step engine-1b 220 python3 ops/bench/engine/engine.py --device cuda --model-size 1b --profile \
  --workload mixed-gpu --out "$O/engine.json"
# 3. the host step on the device's CPU (no GPU work: the model is stubbed)
step host-step 70 python3 ops/bench/engine/host_step.py --steps 80 && \
  cp ops/bench/results/host_step.json "$O/host_step.json"
# 4. 8B throughput-256 (Ferry rows only)
step engine-8b 200 python3 ops/bench/engine/engine.py --device cuda --model-size 8b \
  --workload throughput-256 --skip variants hf --out "$O/engine.json"
# 5. the CPU service bench on 16 cores: two workers against one
step service 200 python3 ops/bench/service/service.py --out "$O/service.json"
echo "=== done $(date +%T)"
