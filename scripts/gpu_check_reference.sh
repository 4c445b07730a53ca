#!/usr/bin/env bash
# The reference engine (not vLLM) on one CUDA GPU, on a host with no network and no
# project environment: the system python3 with torch (a CUDA build) and transformers, plus
# the wheels of what it lacks carried in .whl/ (each installed into a scratch folder only where
# the host has no such package or an older one). Then:
#   1. tests/gpu: the engine on CUDA against the CPU (greedy tokens, logits in float32 and
#      bfloat16, loading), prefix-cache snapshots copied in and out of GDN slots, handoffs
#      CUDA -> CUDA, CUDA -> CPU and CPU -> CUDA;
#   2. the reference engine on CUDA through the scheduler and the gateway
#      (scripts/local_stack.py, demo checkpoint, 8 chat requests).
# About 2 minutes on an H200; each step has its own timeout, 6 minutes in all at most.
# Logs in ${OUT:-/tmp/gpu-out}: gpu-check.log (this output), pytest.log, stack.log and the
# stack's scheduler.log, worker.log and gateway.log.
#
# The wheels, fetched beforehand on a host with PyPI (Python 3.12, x86-64: the GPU host's):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl google-crc32c \
#     grpcio grpcio-health-checking grpcio-reflection fastapi uvicorn openai ...
# (the runtime dependencies of pyproject.toml and of the gateway that the host lacks:
# the environment step below imports each and names any that is missing).
#
#   scripts/gpu_check_reference.sh
#   LATTICE_TEST_DEVICE=cpu scripts/gpu_check_reference.sh   dry run without a GPU: the same
#                       steps with the CPU as the device (LATTICE_WHEELS=DIR: other wheels,
#                       e.g. for another Python; PYTHON=...: another interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
PYTHON=${PYTHON:-python3}
WHEELS=${LATTICE_WHEELS:-.whl}
DEVICE=${LATTICE_TEST_DEVICE:-cuda}
SITE=${LATTICE_SITE:-$(mktemp -d -t lattice-site.XXXXXX)}  # the carried wheels, installed
export LATTICE_TEST_DEVICE=$DEVICE PYTHONUNBUFFERED=1 OUT PYTHON WHEELS DEVICE SITE
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1

START=$SECONDS
SUMMARY=()
FAILED=0
step() { printf '\n== step [%3ds] %s\n' $((SECONDS - START)) "$*"; }
# run NAME SECONDS FUNCTION: one step (a function of this script, in a bash of its own)
# under a timeout; its outcome goes to the summary.
run() {
  local name=$1 limit=$2 began=$SECONDS rc
  step "$name"
  timeout -k 10 "$limit" bash -c "$3"
  rc=$?
  local outcome=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    outcome="TIMED OUT after ${limit}s"
  elif [ "$rc" != 0 ]; then
    outcome="FAILED (exit $rc)"
  fi
  [ "$outcome" = ok ] || FAILED=1
  SUMMARY+=("$(printf '%-28s %-26s %4ds' "$name" "$outcome" $((SECONDS - began)))")
  return "$rc"
}
finish() {
  step "summary (device $DEVICE)"
  printf '%s\n' "${SUMMARY[@]}"
  if [ "$FAILED" = 0 ]; then
    echo "gpu check reference: PASSED in $((SECONDS - START)) s"
  else
    echo "gpu check reference: FAILED after $((SECONDS - START)) s (logs in $OUT)"
  fi
  exit "$FAILED"
}

install_wheels() {
  # Only what the host lacks or has older: its own newer packages stay in charge.
  rm -rf "$SITE"  # what an earlier run installed is neither counted nor kept
  local wanted
  wanted=$("$PYTHON" - "$WHEELS" <<'EOF'
import importlib.metadata as metadata
import pathlib
import re
import sys


def key(version):
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0]))


wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
if not wheels:
    print(f"no carried wheels in {sys.argv[1]}: using the host's packages", file=sys.stderr)
for wheel in wheels:
    name, version = wheel.name.split("-")[:2]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have is not None and key(have) >= key(version):
        print(f"keep {name} {have} (carried {version})", file=sys.stderr)
    else:
        print(f"install {name} {version} (host: {have or 'none'})", file=sys.stderr)
        print(wheel)
EOF
  ) || return 1
  [ -z "$wanted" ] && return 0
  if "$PYTHON" -m pip --version > /dev/null 2>&1; then
    # shellcheck disable=SC2086 # one path a line, no spaces in wheel names
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" $wanted
  else  # no pip: a wheel is a zip of what --target would hold (none of these has scripts)
    echo "no pip for $PYTHON: unpacking the wheels into $SITE"
    # shellcheck disable=SC2086
    "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" $wanted
  fi
}

probe() {
  command -v nvidia-smi > /dev/null && nvidia-smi -L
  "$PYTHON" - <<'EOF'
import importlib.metadata as metadata
import os
import platform

import torch

device = os.environ["LATTICE_TEST_DEVICE"]
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if device == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    print(f"{props.name}: capability {props.major}.{props.minor}, {total / 2**30:.0f} GiB "
          f"({free / 2**30:.0f} free)")
    try:  # for reading the float32 figures; not every torch has both flags
        print(f"TF32: matmul {torch.backends.cuda.matmul.allow_tf32}, "
              f"cuDNN {torch.backends.cudnn.allow_tf32}")
    except Exception as err:  # noqa: BLE001
        print(f"TF32 flags: {err}")
    torch.ones(1, device="cuda").add_(1)  # the first kernel
for name in ("grpcio", "protobuf", "transformers", "fastapi", "pydantic", "openai", "numpy"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: not installed")
# Everything the stack imports, before any process of it starts.
import google_crc32c, grpc_health.v1.health, grpc_reflection.v1alpha.reflection  # noqa: E401,F401
import openai  # noqa: F401
import service.cli.main, service.gateway.app, worker_client.cli  # noqa: E401,F401
from service.gateway.timeouts import H11Protocol  # noqa: F401
from worker_client.engine.engine import ModelEngine  # noqa: F401
print("imports: ok")
EOF
}

run_tests() {
  "$PYTHON" -m pytest -q tests/gpu -p no:cacheprovider -s -o faulthandler_timeout=120 \
    > "$OUT/pytest.log" 2>&1
  local rc=$?
  grep -o "\[$DEVICE\] .*" "$OUT/pytest.log"  # the measurements
  grep -v -F "[$DEVICE]" "$OUT/pytest.log" | tail -n 60  # failures and the counts
  return "$rc"
}

stack() {
  local state
  state=$(mktemp -d)
  "$PYTHON" scripts/local_stack.py --device "$DEVICE" --workers 1 --requests 8 --exit \
    --port 50151 --metrics-port 9451 --gateway-port 8051 --state-dir "$state" \
    > "$OUT/stack.log" 2>&1
  local rc=$?
  cat "$OUT/stack.log"
  [ "$rc" = 0 ] || return "$rc"
  # The worker must have run the reference engine on the device asked for.
  local worker_log=.artifacts/local-stack/cpu-worker-1.log
  grep -m1 "engine ready" "$worker_log" || { echo "no 'engine ready' in $worker_log"; return 1; }
  grep -q "engine ready.* device=$DEVICE " "$worker_log" \
    || { echo "the worker's engine is not on $DEVICE"; return 1; }
  # Later turns of the demo's conversations resume from the worker's prefix cache there.
  if ! grep -q "^prefix cache: [1-9][0-9]* of" "$OUT/stack.log"; then
    echo "no prompt token resumed from the worker's prefix cache on $DEVICE"
    return 1
  fi
}

export PYTHONPATH="$SITE:$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
export -f install_wheels probe run_tests stack
# 30 + 60 + 150 + 120 s: at most 6 minutes in all.
run "install carried wheels" 30 install_wheels || finish
run "environment" 60 probe || finish
run "pytest tests/gpu" 150 run_tests
rm -rf .artifacts/local-stack  # only this run's logs below
run "local stack on $DEVICE" 120 stack
for log in scheduler cpu-worker-1:worker gateway; do
  cp ".artifacts/local-stack/${log%%:*}.log" "$OUT/${log##*:}.log" 2> /dev/null
done
finish
