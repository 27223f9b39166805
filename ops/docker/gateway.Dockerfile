# Ferry gateway: slim Python, no torch, no CUDA (about 150 MB instead of several GB).
#
#   docker build -f ops/docker/gateway.Dockerfile -t ferry-gateway .
#
# The project is installed with --no-deps, so pyproject's torch/transformers are never
# pulled in; the gateway's own dependencies come from gateway-requirements.txt
# (tests/ops/test_images.py checks it covers every import of protocol/, gateway/
# and the CLI). The same image also runs `ferry top`.
#
# No `# syntax=` line and no `RUN --mount`: any builder (the classic one, BuildKit,
# buildx, kaniko, podman) builds this offline, from a local base image and a local
# package index (docs/operations.md, "Air-gapped").

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# pip reads these when the build passes them (a local wheelhouse or index mirror).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY ops/docker/gateway-requirements.txt ./
RUN pip install -r gateway-requirements.txt
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY observability ./observability
COPY ferry ./ferry
RUN pip install --no-deps . \
 && python -c "import gateway.app, ferry.cli, ferry.commands.top; import importlib.util as u; assert u.find_spec('torch') is None"

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ferry
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 FERRY_LOG_JSON=1
USER ferry
WORKDIR /home/ferry
EXPOSE 8000
CMD ["ferry", "gateway", "--redis-url", "redis://redis:6379/0", "--host", "0.0.0.0", "--port", "8000"]
