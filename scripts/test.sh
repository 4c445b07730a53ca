#!/usr/bin/env bash
# Set up (scripts/setup.sh, and .venv-vllm: scripts/setup.sh --engine vllm), make sure
# Prometheus' tools and PostgreSQL's binaries are there, run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."

# The tests also run a real evaluation harness (lm-eval, the `eval` extra).
LATTICE_SETUP_EXTRAS=eval scripts/setup.sh
# vLLM's own environment, for tests/vllm (vLLM workers against plain vLLM).
scripts/setup.sh --engine vllm
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing Prometheus (Debian package) for the observability tests"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "test: prometheus/promtool not found and cannot install them (not root);" \
         "the observability tests will be skipped"
  fi
fi
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing PostgreSQL (Debian package) for the replica tests"
    # The tests start private clusters of their own: no default cluster, no server left running.
    mkdir -p /etc/postgresql-common
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "test: PostgreSQL binaries (initdb, pg_ctl) not found and cannot install them" \
         "(not root); the replica tests will be skipped"
  fi
fi
exec .venv/bin/python -m pytest "$@"
