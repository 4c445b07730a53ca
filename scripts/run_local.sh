#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the local stack: scheduler + 2 CPU workers (tiny model)
# + a demo load. Arguments go to scripts/local_stack.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/local_stack.py "$@"
