#!/usr/bin/env bash
# Stand-ins for the public base images, built from Debian's package mirror alone, for a
# machine that reaches no container registry (air-gapped, or behind a package mirror):
#
#   eval "$(bash ops/docker/local-base-images.sh)"   # sets FERRY_PYTHON_IMAGE, FERRY_REDIS_IMAGE
#   docker compose --profile cpu build gateway worker-cpu
#
#   ferry-local/debian:bookworm   debootstrap --variant=minbase, `docker import`ed
#   ferry-local/python:3.11       + Debian's python3 (3.11), venv, `python` on PATH
#   ferry-local/redis:7           + Debian's redis-server 7 (data in /data)
#
# Idempotent: an image that exists is kept, and the debootstrap tarball is cached under
# FERRY_IMAGE_CACHE (default ~/.cache/ferry/images), so only the first run on a machine
# pays for debootstrap (about a minute). Needs root (debootstrap) and a Docker engine.
# Prints the compose variables on stdout; progress goes to stderr.
set -euo pipefail
CACHE="${FERRY_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry/images}"
SUITE=bookworm
# the mirror: DEBIAN_MIRROR, or the one this machine's apt already uses (apt-mirror.sh)
MIRROR="${DEBIAN_MIRROR:-$(bash "$(dirname "${BASH_SOURCE[0]}")/apt-mirror.sh" "$SUITE")}"
DEBIAN="ferry-local/debian:$SUITE"
PYTHON="ferry-local/python:3.11"
REDIS="ferry-local/redis:7"

say() { echo "[base-images] $*" >&2; }
have() { docker image inspect "$1" >/dev/null 2>&1; }

debian_image() {
  have "$DEBIAN" && return
  local tarball="$CACHE/debian-$SUITE-minbase.tar"
  if [ ! -s "$tarball" ]; then
    if ! command -v debootstrap >/dev/null 2>&1; then
      say "installing debootstrap"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null 2>&1 \
        || { say "apt-get could not install debootstrap"; exit 1; }
    fi
    local root
    root="$(mktemp -d)"
    say "debootstrap $SUITE (minbase) from $MIRROR"
    mkdir -p "$CACHE"
    debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    tar -C "$root" --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' \
      --exclude='./var/cache/apt/archives/*.deb' -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
  fi
  say "docker import $DEBIAN"
  docker import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tarball" "$DEBIAN" >/dev/null
}

derived_image() {  # tag, then the Dockerfile on stdin
  local tag="$1"
  have "$tag" && { cat >/dev/null; return; }
  say "building $tag"
  # The classic builder on the host network: it needs no buildx and reaches the mirror.
  DOCKER_BUILDKIT=0 docker build -q --network host -t "$tag" - >"$CACHE/build.log" 2>&1 \
    || { tail -20 "$CACHE/build.log" >&2; exit 1; }
}

mkdir -p "$CACHE"
debian_image
derived_image "$PYTHON" <<EOF
FROM $DEBIAN
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
CMD ["python"]
EOF
derived_image "$REDIS" <<EOF
FROM $DEBIAN
RUN apt-get update \\
 && apt-get install -y --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
CMD ["redis-server"]
EOF
echo "export FERRY_PYTHON_IMAGE=$PYTHON FERRY_REDIS_IMAGE=$REDIS"
