# reprotrain image: the hashed lock installed into a venv, the trainer as entrypoint.
# Build with `make docker-build` (Docker or Podman; docs/container.md). The base is
# docker/base-image.env's (pinned by digest once `make pin-base` has run), or BASE_REF=<a local
# image>, e.g. the Debian one `make docker-base` builds where no registry is reachable. Both
# kinds of base work: the official image's Python lives in /usr/local and has `python`, Debian's
# in /usr with only `python3`; every stage calls `python3` until /opt/venv is first on PATH.
# Stages: base -> builder (runtime lock) -> runtime (default), and builder -> builder-dev (+ dev
# lock) -> test. No syntax line: it would fetch a frontend image from a registry. RUN --mount
# (the CA secret) needs BuildKit (Docker >= 23 by default) or Podman/Buildah.

# BASE_REF is "tag", "tag@sha256:..." or a local image; keep the default equal to BASE_IMAGE in
# docker/base-image.env (tests/test_docker.py checks it).
ARG BASE_REF=python:3.11-slim-bookworm
# antlr4-python3-runtime 4.9.3 (pinned by hydra-core) is published only as an sdist; it is
# pure Python and still hash-checked. Everything else must be a wheel (the same allowlist as
# SDIST_ONLY in src/reprotrain/repro/lock_platforms.py, which `make check-lock` applies).
ARG SDIST_ONLY=antlr4-python3-runtime

FROM ${BASE_REF} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 1000 --user-group app
WORKDIR /app

# ---- builder: /opt/venv from the runtime lock, in one step per lock: each file the lock names
# for this Python is downloaded from the package registry (the build's only network use) and
# hash-checked, then installed from that folder alone (--no-index), which the same step deletes.
# Behind a TLS-inspecting proxy, `make docker-build` hands pip the host's CA bundle as the
# build secret ca_bundle (CA_BUNDLE=, default pip's own $PIP_CERT): never stored in a layer.
# The lock and docker/pip-lock.sh stay in /build, out of /app.
FROM base AS builder
ARG SDIST_ONLY
WORKDIR /build
COPY requirements.lock docker/pip-lock.sh ./
RUN --mount=type=secret,id=ca_bundle,target=/run/secrets/ca_bundle \
    sh pip-lock.sh download /tmp/wheels requirements.lock \
    && sh pip-lock.sh install /tmp/wheels requirements.lock && rm -rf /tmp/wheels

FROM builder AS builder-dev
ARG SDIST_ONLY
COPY requirements-dev.lock ./
RUN --mount=type=secret,id=ca_bundle,target=/run/secrets/ca_bundle \
    sh pip-lock.sh download /tmp/wheels requirements-dev.lock \
    && sh pip-lock.sh install /tmp/wheels requirements-dev.lock && rm -rf /tmp/wheels

# ---- test: `make docker-test` runs the suite here; `make train` works as on the host (.venv
# is /opt/venv, its stamp newer than the locks, the package installed editable from /app/src).
FROM builder-dev AS test
ARG BASE_REF
ARG BASE_ID=
ARG IMAGE_TAG=reprotrain:dev-test
ARG GIT_COMMIT=
WORKDIR /app
# The official slim image has no make; Debian's base (make docker-base) has it.
RUN command -v make >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*; }
ENV PYTHONHASHSEED=0 \
    CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    PYTHONPATH=/app/src \
    REPROTRAIN_IMAGE=${IMAGE_TAG} \
    REPROTRAIN_BASE_IMAGE=${BASE_REF} \
    REPROTRAIN_BASE_ID=${BASE_ID} \
    REPROTRAIN_GIT_COMMIT=${GIT_COMMIT}
# The whole (.dockerignore-filtered) tree: the suite checks the locks, Makefile and this file.
# --ignore-requires-python: Debian bookworm's python3 is 3.11.2, below pyproject's 3.11.4 (the
# tarfile data filter, for archives: docs/container.md says what fails there); no effect else.
COPY . .
RUN ln -s /opt/venv .venv \
    && pip install --quiet --no-deps --no-build-isolation --no-index --ignore-requires-python -e . \
    && touch .venv/.installed \
    && mkdir -p /app/data /app/outputs && chown -R app:app /app
USER 1000:1000
ENTRYPOINT ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]

# ---- runtime (default target): the trainer, on the builder's venv as it is (a copy of /opt/venv
# into a fresh stage would write its 5 GB again, and store it twice).
FROM builder AS runtime
WORKDIR /app
ARG BASE_REF
ARG BASE_ID=
ARG IMAGE_TAG=reprotrain:dev
ARG GIT_COMMIT=
# Hash seed and cuBLAS workspace must be fixed before the interpreter / first CUDA call (the
# workspace no longer guards determinism in torch 2.14; it sizes cuBLAS's workspace, which
# bounds its kernel choice, and is recorded and compared like any part of the environment).
# The NVIDIA variables tell the GPU container runtime to expose the devices and driver libs.
# NVIDIA_REQUIRE_CUDA: the locked torch wheels bring the CUDA 13.0 runtime (nvidia-cuda-runtime
# 13.0.x), which needs a driver that supports CUDA 13.0 (R580 or newer). The container toolkit
# checks this at start and refuses an older driver in one line, where torch would otherwise
# find no usable GPU and trainer.device=auto would train on the CPU.
# REPROTRAIN_* are read by reprotrain.repro.environment.container_image() into run.json; the
# image's own ID exists only once it is built: `make docker-train` passes it at start.
ENV PYTHONHASHSEED=0 \
    CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA=cuda>=13.0 \
    PYTHONPATH=/app/src \
    REPROTRAIN_IMAGE=${IMAGE_TAG} \
    REPROTRAIN_BASE_IMAGE=${BASE_REF} \
    REPROTRAIN_BASE_ID=${BASE_ID} \
    REPROTRAIN_GIT_COMMIT=${GIT_COMMIT}
# Only the runtime lock: it is what this venv was built from and what the trainer's drift
# check compares against (the dev lock would report every dev tool as missing).
COPY pyproject.toml requirements.in requirements.lock ./
COPY src ./src
COPY conf ./conf
RUN mkdir -p /app/data /app/outputs && chown app:app /app /app/data /app/outputs
VOLUME ["/app/data", "/app/outputs"]
USER 1000:1000
ENTRYPOINT ["python", "-m", "reprotrain.train"]
CMD []
