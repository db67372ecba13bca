# syntax=docker/dockerfile:1
# The pdproxy image: the proxy and its registry, nothing else (no torch: the KV connector and
# its transforms live in the `worker` extra, which belongs in the vLLM image, not here). Its
# hot path is compiled with mypyc (setup.py, PDPROXY_COMPILE=1); `pdproxy --version` says so.
#
#   docker build -t pdproxy:0.1.0 .
#   docker run --rm -p 8000:8000 -p 30001:30001 pdproxy:0.1.0 [serve flags...]
#
# Arguments after the image name are `pdproxy serve` flags; every flag is also a PDPROXY_<NAME>
# environment variable (e.g. PDPROXY_PORT, which the HEALTHCHECK reads too) or a key of the
# YAML file given with --config. The image also carries `pdproxy fake-worker` (used by the
# docker-compose demo): `docker run --entrypoint pdproxy pdproxy:0.1.0 fake-worker --help`.
#
# tests/deploy/test_dockerfile.py lints this file with hadolint and runs the install steps of
# the build stage below in a fresh venv; keep those steps plain `RUN` lines.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The same Python with a C compiler: the build stage compiles the hot path (setup.py, mypyc).
ARG BUILD_IMAGE=python:3.11-bookworm

# ---- build: the compiled pdproxy and its dependencies in a self-contained venv --------------
FROM ${BUILD_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE setup.py ./
COPY build_support ./build_support
COPY pdproxy ./pdproxy
# A throwaway venv for the compiler: mypy, and pdproxy's dependencies, which it type-checks
# against. Only the wheel it builds goes into /opt/pdproxy.
RUN python -m venv /src/compiler \
    && /src/compiler/bin/pip install --no-cache-dir setuptools==84.0.0 wheel==0.48.0 mypy==2.4.0 .
RUN PDPROXY_COMPILE=1 /src/compiler/bin/pip wheel --no-cache-dir --no-build-isolation --no-deps \
    --wheel-dir /src/wheels .
# With the extras its flags need: kubernetes (`--discovery kubernetes`, which the chart can turn
# on), otel (`--otel-exporter`) and fake-worker (aiohttp: docker-compose's demo runs `pdproxy
# fake-worker` from this image). The loop names the one wheel, whose file name a glob must find.
RUN python -m venv /opt/pdproxy \
    && for wheel in /src/wheels/pdproxy-*.whl; do \
         /opt/pdproxy/bin/pip install --no-cache-dir "${wheel}[fake-worker,kubernetes,otel]"; \
       done

# ---- runtime: the venv on a clean base, run as an unprivileged user --------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="pdproxy" \
      org.opencontainers.image.description="Front door for prefill/decode-disaggregated vLLM fleets: OpenAI-compatible proxy and ZMQ registry" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

RUN groupadd --system --gid 10001 pdproxy \
    && useradd --system --no-log-init --uid 10001 --gid pdproxy --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin pdproxy

COPY --from=build /opt/pdproxy /opt/pdproxy

ENV PATH=/opt/pdproxy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /tmp

# 8000: OpenAI-compatible HTTP, /health, /ready, /metrics. 30001: the ZMQ registry workers
# announce to (vLLM's proxy_ip:proxy_port).
EXPOSE 8000 30001

# Standard library only (the image has no curl). Follows PDPROXY_PORT when the port is moved
# that way; a port moved only by flag or config file needs --health-cmd adjusted to match.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PDPROXY_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["pdproxy", "serve"]
CMD []
