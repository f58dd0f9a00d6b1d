# syntax=docker/dockerfile:1
# reprotrain image: the hashed lock installed into a venv, the trainer as entrypoint.
# Build with `make docker-build` (passes the base from docker/base-image.env, pinned by digest
# once `make pin-base` has run, and tags reprotrain:<commit>-<lock sha256[:12]>).
# Stages: base -> builder (runtime lock) -> builder-dev (+ dev lock) -> test; runtime (default).

# BASE_REF is "tag" or "tag@sha256:..."; keep the default equal to BASE_IMAGE in
# docker/base-image.env (tests/test_docker.py checks it).
ARG BASE_REF=python:3.11-slim-bookworm

FROM ${BASE_REF} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 1000 --user-group app
WORKDIR /app

# ---- builder: every distribution comes from the lock, hash-checked, no resolver.
FROM base AS builder
# antlr4-python3-runtime 4.9.3 (pinned by hydra-core) is published only as an sdist; it is
# pure Python and still hash-checked. Everything else must be a wheel (the same allowlist as
# SDIST_ONLY in src/reprotrain/repro/lock_platforms.py, which `make check-lock` applies).
ARG SDIST_ONLY=antlr4-python3-runtime
COPY requirements.lock ./
RUN python -m venv /opt/venv \
    && pip install --require-hashes --no-deps --only-binary :all: \
       --no-binary "${SDIST_ONLY}" -r requirements.lock

FROM builder AS builder-dev
COPY requirements-dev.lock ./
RUN pip install --require-hashes --no-deps --only-binary :all: -r requirements-dev.lock

# ---- test: `make docker-test` runs the suite inside the image with the dev lock.
FROM base AS test
ENV PYTHONHASHSEED=0 \
    CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    PYTHONPATH=/app/src
COPY --from=builder-dev /opt/venv /opt/venv
# The whole (.dockerignore-filtered) tree: the suite checks the locks, Makefile and this file.
COPY . .
RUN mkdir -p /app/data /app/outputs && chown -R app:app /app
USER 1000:1000
ENTRYPOINT ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]

# ---- runtime (default target): the trainer.
FROM base AS runtime
ARG BASE_REF
ARG BASE_DIGEST=
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
# REPROTRAIN_* are read by reprotrain.repro.requirements_lock.container_image() into run.json.
ENV PYTHONHASHSEED=0 \
    CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA=cuda>=13.0 \
    PYTHONPATH=/app/src \
    REPROTRAIN_IMAGE=${IMAGE_TAG} \
    REPROTRAIN_IMAGE_DIGEST=${BASE_DIGEST} \
    REPROTRAIN_BASE_IMAGE=${BASE_REF} \
    REPROTRAIN_GIT_COMMIT=${GIT_COMMIT}
COPY --from=builder /opt/venv /opt/venv
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
