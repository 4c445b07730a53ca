# syntax=docker/dockerfile:1
#
# One Dockerfile, two images:
#   --target scheduler (default): the scheduler, the client CLI (load generator) and the
#     OpenAI-compatible gateway (`lattice-scheduler gateway`); no torch.
#   --target worker: the same plus torch, for lattice-worker (and the demo checkpoint).
# Torch comes from TORCH_INDEX_URL: the CPU wheel index by default; for a GPU image use
# the PyPI index (its Linux wheels bundle CUDA), e.g.
#   docker build --target worker --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
# docker-compose.gpu.yml does exactly that. A torch wheel in .cache/compose/wheels/ is used
# instead of any index (offline builds: scripts/compose_check.sh, docs/operations.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- a virtual environment at /opt/venv, copied whole into the runtime images ---------
FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

# The sources only (not the wheels of an offline build).
FROM venv AS sources
COPY pyproject.toml constraints.txt README.md /src/
COPY protos /src/protos
COPY common /src/common
COPY service /src/service
COPY worker_client /src/worker_client

FROM venv AS scheduler-build
COPY --from=sources /src /src
RUN pip install -c /src/constraints.txt "/src[gateway,postgres]"

FROM venv AS worker-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Before the sources, so that a code change does not download torch again. The other
# dependencies are pinned by constraints.txt, as in scripts/setup.sh.
# The glob copies the wheels folder when there is one and nothing otherwise.
COPY constraints.txt .cache/compose/wheel[s] /tmp/wheels/
RUN if ls /tmp/wheels/torch-*.whl > /dev/null 2>&1; then pip install /tmp/wheels/torch-*.whl; \
    else pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; fi \
    && rm -rf /tmp/wheels
COPY --from=sources /src /src
RUN pip install -c /src/constraints.txt "/src[worker,gateway]"

# -- runtime: no compiler, no pip cache, not root ---------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --user-group --home-dir /home/lattice --create-home lattice \
    && install -d -o 10001 -g 10001 /var/lib/lattice \
    && install -d -o 10001 -g 10001 /models
COPY deploy/grpc_health_check.py /opt/lattice/grpc_health_check.py
WORKDIR /home/lattice
USER 10001:10001

FROM runtime AS worker
COPY --from=worker-build /opt/venv /opt/venv
ENTRYPOINT ["lattice-worker"]
CMD ["--help"]

# The vLLM worker image has a Dockerfile of its own (deploy/vllm.Dockerfile): the legacy
# builder builds every stage before its target, and would build vLLM for these images too.

# Last, so that a plain `docker build .` gives the scheduler image.
FROM runtime AS scheduler
COPY --from=scheduler-build /opt/venv /opt/venv
EXPOSE 50051 9400 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "/opt/lattice/grpc_health_check.py", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["lattice-scheduler"]
# The queue survives restarts in /var/lib/lattice: mount a volume there (compose does).
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400", \
     "--state-dir", "/var/lib/lattice"]
