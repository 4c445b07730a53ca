#!/usr/bin/env bash
# Create .venv and install the project with everything the worker and the tests need.
# Idempotent: a second run with the same pyproject.toml and constraints.txt does nothing.
#   PYTHON=python3.11 scripts/setup.sh      choose the interpreter
#   LATTICE_KEEP_TORCH=1 scripts/setup.sh   keep a torch already in .venv (a CUDA build on GPU hosts)
#   LATTICE_SETUP_EXTRAS=eval scripts/setup.sh   more extras (scripts/test.sh adds `eval`)
#   scripts/setup.sh --engine vllm          instead: .venv-vllm, vLLM's environment (below)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--engine" ] && [ "${2:-}" = "vllm" ]; then
  exec scripts/setup_vllm.sh
elif [ $# -gt 0 ]; then
  echo "setup: unknown arguments: $* (only --engine vllm)" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
extras="worker,gateway,postgres,test,reference,sim${LATTICE_SETUP_EXTRAS:+,$LATTICE_SETUP_EXTRAS}"
stamp=".venv/.setup-$( (cat pyproject.toml constraints.txt; echo "$extras") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
# The environment takes about 2 GB and pip unpacks the wheels in the temporary folder first;
# a full disk otherwise fails deep in pip's output.
# (Python, and so pip, takes /tmp where TMPDIR is not a folder; a df that cannot tell
# skips the check.)
tmp=${TMPDIR:-/tmp}
[ -d "$tmp" ] || tmp=/tmp
for dir in . "$tmp"; do
  free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 { print $4 }') || free_kb=
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((3 * 1024 * 1024)) ]; then
    echo "setup: $dir has $((free_kb / 1024)) MB free; installing needs about 3 GB" >&2
    exit 1
  fi
done
echo "setup: installing the project and its dependencies into .venv (first run takes a minute)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
if [ "${LATTICE_KEEP_TORCH:-0}" != 1 ]; then
  # CPU wheel: an unpinned torch would pull a multi-gigabyte CUDA build.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  -c constraints.txt -e ".[$extras]"
rm -f .venv/.setup-*
touch "$stamp"
echo "setup: done"
