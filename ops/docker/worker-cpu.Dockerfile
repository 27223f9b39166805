# Ferry CPU worker: slim Python + the CPU build of torch + the ferry package. No CUDA
# libraries and no triton (a CPU worker never launches a Triton kernel): about a third of
# the GPU image's size (docs/operations.md gives the measured sizes).
#
#   docker build -f ops/docker/worker-cpu.Dockerfile -t ferry-worker-cpu .
#
# The C++ paged-decode kernel is built on first use for the CPU it runs on
# (kernels/native_build.py: -march=native), so the runtime image keeps g++; without a
# compiler the worker falls back to torch attention, loudly.
#
# No `# syntax=` line and no `RUN --mount`: any builder builds this offline, from a
# local base image and a local package index (docs/operations.md, "Air-gapped").

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# torch's CPU build lives on an index of its own (PyPI's default build bundles CUDA):
# TORCH_INDEX_URL names it (PyTorch's install page gives the address), or pip's own
# configuration (PIP_INDEX_URL, PIP_FIND_LINKS) serves a CPU build.
ARG TORCH_SPEC="torch>=2.4,<2.16"
ARG TORCH_INDEX_URL=
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC}" \
 && python -c "import torch; assert torch.version.cuda is None, 'a CUDA build of torch ' \
    f'({torch.version.cuda}): set FERRY_TORCH_INDEX_URL to an index of CPU builds'"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY observability ./observability
COPY ferry ./ferry
RUN pip install . \
 && python -c "import torch, worker.engine, ferry.cli; import importlib.util as u; assert u.find_spec('triton') is None"

FROM ${PYTHON_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin ferry \
 && mkdir -p /cache/huggingface /cache/kernels /models \
 && chown -R ferry:ferry /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    FERRY_KERNEL_CACHE=/cache/kernels \
    FERRY_HEALTH_FILE=/tmp/ferry-worker.health \
    FERRY_DEVICE=cpu \
    FERRY_LOG_JSON=1
USER ferry
WORKDIR /home/ferry
EXPOSE 9100
STOPSIGNAL SIGTERM
CMD ["ferry", "worker", "--redis-url", "redis://redis:6379/0", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"]
