#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the local stack: scheduler (or `--replicas N` on a
# private PostgreSQL cluster) + 2 CPU workers (tiny model with a tokenizer, built on the
# first run; --engine vllm: vLLM workers from .venv-vllm) + the OpenAI-compatible gateway
# + a demo load through the gateway. Arguments go to scripts/local_stack.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
previous=""
for arg in "$@"; do
  # `--engine vllm`: the workers run from .venv-vllm.
  if [ "$previous $arg" = "--engine vllm" ] || [ "$arg" = --engine=vllm ]; then
    scripts/setup.sh --engine vllm
  fi
  previous=$arg
done
exec .venv/bin/python scripts/local_stack.py "$@"
