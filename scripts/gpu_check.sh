#!/usr/bin/env bash
# On one CUDA GPU: the reference engine against the CPU and through the scheduler
# (scripts/gpu_check_reference.sh, which also runs alone on a host without network or
# project environment), then a vLLM worker (CUDA graphs on) through the
# scheduler on the tiny checkpoint, a real Qwen3.5 directory when given, then the
# benchmark's figures (bench/vllm.py --device cuda). Within about 8 minutes once both
# environments exist (the first setup downloads vLLM and CUDA torch: minutes more).
#   scripts/gpu_check.sh                  the tiny checkpoints only
#   scripts/gpu_check.sh /path/Qwen3.5    also a real Qwen3.5 checkpoint directory
set -euo pipefail
cd "$(dirname "$0")/.."
REAL_MODEL=${1:-}
START=$SECONDS
step() { printf '\n== gpu check [%3ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { printf 'gpu check FAILED [%ds]: %s\n' $((SECONDS - START)) "$*" >&2; exit 1; }

command -v nvidia-smi > /dev/null && nvidia-smi -L | head -1 || fail "no nvidia-smi: no CUDA GPU here"
step "setup: .venv (CUDA torch from PyPI) and .venv-vllm (vllm==0.32.0)"
scripts/setup.sh
scripts/setup.sh --engine vllm
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch in .venv sees no GPU'" \
  || fail ".venv's torch is a CPU build: rm -r .venv and rerun on this GPU host"
SETUP_DONE=$SECONDS

step "reference engine on CUDA: tests/gpu against the CPU, then through the scheduler"
# The same checks as on a host without the project's environment, with .venv's packages
# (any carried wheels in .whl/ install only where .venv's are older).
PYTHON=.venv/bin/python scripts/gpu_check_reference.sh || fail "reference engine on CUDA"

step "vLLM worker, CUDA graphs on, through the scheduler (wide demo checkpoint, 16 requests)"
timeout 300 .venv/bin/python scripts/local_stack.py --engine vllm --workers 1 --requests 16 \
  --exit --port 50161 --metrics-port 9461 --gateway-port 8061 \
  --state-dir "$(mktemp -d)" || fail "vLLM worker stack"
grep -q "cuda_graphs=True" .artifacts/local-stack/cpu-worker-1.log \
  || fail "the vLLM worker did not run with CUDA graphs"
if grep -q "cannot run the decision" .artifacts/local-stack/cpu-worker-1.log; then
  fail "the vLLM worker refused a decision (see .artifacts/local-stack/cpu-worker-1.log)"
fi

if [ -n "$REAL_MODEL" ]; then
  step "vLLM worker on $REAL_MODEL"
  timeout 300 .venv/bin/python scripts/local_stack.py --engine vllm --workers 1 \
    --model "$REAL_MODEL" --requests 16 --exit --port 50171 --metrics-port 9471 \
    --gateway-port 8071 --state-dir "$(mktemp -d)" || fail "vLLM worker on $REAL_MODEL"
fi

step "benchmark: Lattice + vLLM workers against plain vllm serve"
timeout 420 .venv/bin/python -m bench.vllm --quick --device cuda || fail "bench.vllm"
step "done: $((SECONDS - SETUP_DONE)) s after setup"
