# Ferry GPU worker: CUDA runtime + torch + triton + the ferry package.
#
#   docker build -f ops/docker/worker.Dockerfile -t ferry-worker .
#
# Two stages: `build` creates a virtualenv at /opt/venv (compilers for any sdist),
# `runtime` copies only that venv onto a clean CUDA runtime image. Torch wheels from PyPI
# bundle their CUDA libraries and require their matching triton; the CUDA base supplies
# the driver-facing runtime the NVIDIA container toolkit expects. Triton compiles a small
# C launcher the first time a kernel runs, so the runtime image keeps gcc and the Python
# headers. CPU workers use worker-cpu.Dockerfile (no CUDA, no triton).
#
# No `# syntax=` line and no `RUN --mount`: any builder builds this offline, from a
# local base image and a local package index (docs/operations.md, "Air-gapped").

ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# The heavy, rarely changing layer first: torch (with its CUDA wheels) and triton.
ARG TORCH_SPEC="torch>=2.4,<2.16"
RUN pip install "${TORCH_SPEC}" "triton>=3.0,<4"
# Then the project and its remaining dependencies (from pyproject.toml).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY observability ./observability
COPY ferry ./ferry
RUN pip install ".[gpu]" \
 && python -c "import torch, triton, worker.engine, ferry.cli"

FROM ${CUDA_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin ferry \
 && mkdir -p /cache/huggingface /cache/triton /cache/kernels /models \
 && chown -R ferry:ferry /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    FERRY_KERNEL_CACHE=/cache/kernels \
    FERRY_HEALTH_FILE=/tmp/ferry-worker.health \
    FERRY_LOG_JSON=1
USER ferry
WORKDIR /home/ferry
EXPOSE 9100
# The worker drains on SIGTERM (stops reading the stream, finishes its batch, exits).
STOPSIGNAL SIGTERM
CMD ["ferry", "worker", "--redis-url", "redis://redis:6379/0", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"]
