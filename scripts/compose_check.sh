#!/usr/bin/env bash
# `docker compose up` of the local stack on a machine with no image registry (CI, as root):
# installs what is missing (Debian's docker.io and debootstrap; Compose v2 from Debian
# trixie's docker-compose package), builds the base images from Debian's packages, builds
# the stack's images, brings it up, waits for every health check, streams a chat completion
# through the gateway container's published port, checks that the Prometheus container
# scrapes the scheduler and the gateway, and takes everything down with its volumes.
# Grafana has no Debian package: it is not started here (tests/stack checks its files).
#
# Cached under .cache/compose/ (git-ignored): the apt downloads, the bookworm root, the
# torch wheel; and the images in Docker's own store. A second run skips what it has.
#   scripts/compose_check.sh            as root
#   LATTICE_COMPOSE_KEEP=1 ...          leave the stack up (take it down yourself)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=$REPO/.cache/compose
mkdir -p "$CACHE"
START=$SECONDS
PROJECT=lattice-check
BASE_IMAGE=python:3.11-slim-bookworm          # the name the Dockerfile uses
PROMETHEUS_IMAGE=lattice-prometheus:debian
export DOCKER_BUILDKIT=0                        # the classic builder: no buildx here

phase() { printf '\n== compose check [%3ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { printf 'compose check FAILED [%ds]: %s\n' $((SECONDS - START)) "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "run as root (it installs packages and starts dockerd)"

phase "tools: docker.io, debootstrap"
if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker.io debootstrap > "$CACHE/apt-install.log" 2>&1 \
    || { apt-get update -q > /dev/null \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
              docker.io debootstrap > "$CACHE/apt-install.log" 2>&1; } \
    || fail "apt-get install docker.io debootstrap (log: $CACHE/apt-install.log)"
fi

# apt with a private sources list and state, so that the system's apt config is untouched.
APT_DIR=$CACHE/apt
APT_OPTS=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=-"
          -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache"
          -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=-"
          -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
apt_download() {  # NAME/RELEASE: the .deb's contents extracted into $APT_DIR/NAME
  local name=${1%/*}
  [ -d "$APT_DIR/$name" ] && return 0
  if [ ! -f "$APT_DIR/lists/.updated" ]; then
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
    printf 'deb http://deb.debian.org/debian %s main\n' bookworm trixie > "$APT_DIR/sources.list"
    apt-get "${APT_OPTS[@]}" update -q > "$APT_DIR/update.log" 2>&1 \
      || fail "apt-get update of the private trixie list (log: $APT_DIR/update.log)"
    touch "$APT_DIR/lists/.updated"
  fi
  (cd "$APT_DIR" && apt-get "${APT_OPTS[@]}" download -q "$1" > /dev/null 2>&1) \
    || fail "apt-get download $1"
  dpkg-deb -x "$APT_DIR/${name}"_*.deb "$APT_DIR/$name.tmp" && mv "$APT_DIR/$name.tmp" "$APT_DIR/$name"
}

phase "Compose v2: docker-compose from Debian trixie"
apt_download docker-compose/trixie
COMPOSE_BIN=$APT_DIR/docker-compose/usr/libexec/docker/cli-plugins/docker-compose
"$COMPOSE_BIN" version

phase "Docker engine"
STARTED_DOCKERD=""
if ! docker info > /dev/null 2>&1; then
  for driver in overlay2 vfs; do
    dockerd --storage-driver "$driver" > "$CACHE/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do
      docker info > /dev/null 2>&1 && break 2
      kill -0 "$STARTED_DOCKERD" 2> /dev/null || break
      sleep 0.5
    done
    echo "dockerd with $driver did not start (log: $CACHE/dockerd.log)"
    kill "$STARTED_DOCKERD" 2> /dev/null || true; wait "$STARTED_DOCKERD" 2> /dev/null || true
    STARTED_DOCKERD=""
  done
  docker info > /dev/null 2>&1 || fail "no Docker engine (log: $CACHE/dockerd.log)"
fi
docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}'

compose() { "$COMPOSE_BIN" -p "$PROJECT" -f docker-compose.yml -f "$CACHE/override.yml" "$@"; }
cleanup() {
  local rc=$?
  if [ "${LATTICE_COMPOSE_KEEP:-0}" != 1 ] && [ -f "$CACHE/override.yml" ]; then
    phase "down, with the volumes"
    [ $rc = 0 ] || compose logs --no-color --tail 40 2>&1 | tail -n 200 || true
    compose down --volumes --remove-orphans --timeout 20 || true
  fi
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2> /dev/null || true; wait "$STARTED_DOCKERD" 2> /dev/null || true
  fi
  printf '\ncompose check: %s in %ds\n' "$([ $rc = 0 ] && echo passed || echo FAILED)" \
    $((SECONDS - START))
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

phase "base image $BASE_IMAGE: a bookworm root with python3 (debootstrap)"
if ! docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
  ROOT_TAR=$CACHE/bookworm-python3.tar
  if [ ! -f "$ROOT_TAR" ]; then
    ROOT=$CACHE/bookworm.tmp
    rm -rf "$ROOT"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
      bookworm "$ROOT" http://deb.debian.org/debian > "$CACHE/debootstrap.log" 2>&1 \
      || fail "debootstrap bookworm (log: $CACHE/debootstrap.log)"
    # The package registries are reached through this machine's CA bundle only.
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$ROOT/etc/pip.conf"
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
    tar -C "$ROOT" -cf "$ROOT_TAR.tmp" . && mv "$ROOT_TAR.tmp" "$ROOT_TAR" && rm -rf "$ROOT"
  fi
  docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$ROOT_TAR" "$BASE_IMAGE"
fi

phase "Prometheus image $PROMETHEUS_IMAGE: Debian bookworm's prometheus binary"
if ! docker image inspect "$PROMETHEUS_IMAGE" > /dev/null 2>&1; then
  apt_download prometheus/bookworm
  printf 'FROM %s\nCOPY usr/bin/prometheus /bin/prometheus\nWORKDIR /prometheus\nENTRYPOINT ["/bin/prometheus"]\n' \
    "$BASE_IMAGE" > "$APT_DIR/prometheus.Dockerfile"
  docker build -q -t "$PROMETHEUS_IMAGE" -f "$APT_DIR/prometheus.Dockerfile" "$APT_DIR/prometheus"
fi

phase "torch wheel into the build context (.cache/compose/wheels)"
mkdir -p "$CACHE/wheels"
ls "$CACHE"/wheels/torch-2.13.0*.whl > /dev/null 2>&1 \
  || python3 -m pip download -q --no-deps -d "$CACHE/wheels" torch==2.13.0 \
  || fail "pip download torch==2.13.0"
ls "$CACHE/wheels"

# Free loopback ports for this run; the images of the registry-less machine.
read -r GRPC_PORT METRICS_PORT GATEWAY_PORT PROMETHEUS_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
cat > "$CACHE/override.yml" <<EOF
services:
  scheduler:
    ports: !override ["127.0.0.1:$GRPC_PORT:50051", "127.0.0.1:$METRICS_PORT:9400"]
  gateway:
    ports: !override ["127.0.0.1:$GATEWAY_PORT:8000"]
  prometheus:
    image: $PROMETHEUS_IMAGE
    ports: !override ["127.0.0.1:$PROMETHEUS_PORT:9090"]
EOF

# One at a time (the second reuses the first's layers); without the context upload's
# carriage-return progress.
quiet_build() { compose build "$1" 2>&1 | tr '\r' '\n' | grep -v -e '^Sending build context' -e '^$'; }
phase "build the worker image (lattice-worker:local: demo-model, worker-1, worker-2)"
quiet_build demo-model
phase "build the scheduler image (lattice-scheduler:local: scheduler, gateway)"
quiet_build scheduler

phase "up: scheduler, demo-model, 2 workers, gateway, prometheus (not grafana)"
compose up -d --no-build scheduler worker-1 worker-2 gateway prometheus

phase "wait for every health check"
deadline=$((SECONDS + 300))
while :; do
  states=$(docker ps -a --filter "label=com.docker.compose.project=$PROJECT" \
             --format '{{.Label "com.docker.compose.service"}}={{.State}}/{{.Status}}')
  unhealthy=$(grep -v -e 'demo-model=exited/Exited (0)' -e '(healthy)' \
                      -e '^worker-[12]=running' -e '^prometheus=running' <<< "$states" || true)
  [ -z "$unhealthy" ] && break
  if grep -q -e 'exited' -e 'unhealthy' -e 'restarting' <<< "$unhealthy" \
      || [ $SECONDS -ge $deadline ]; then
    printf '%s\n' "$states"
    fail "not healthy: $(tr '\n' ' ' <<< "$unhealthy")"
  fi
  sleep 2
done
printf '%s\n' "$states" | sort

phase "a streamed chat completion through the gateway (127.0.0.1:$GATEWAY_PORT)"
python3 - "$GATEWAY_PORT" <<'EOF'
import json, sys, urllib.request
port = sys.argv[1]
models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10))
model = models["data"][0]["id"]
body = json.dumps({"model": model, "stream": True, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "Say hello"}]}).encode()
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
chunks, finish, text = 0, None, ""
with urllib.request.urlopen(request, timeout=120) as response:
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        chunks += 1
        text += choice["delta"].get("content") or ""
        finish = choice.get("finish_reason") or finish
assert chunks >= 2 and finish in ("stop", "length"), (chunks, finish)
print(f"model {model}: {chunks} chunks, finish_reason {finish}, text {text!r}")
EOF

phase "Prometheus scrapes the scheduler and the gateway (127.0.0.1:$PROMETHEUS_PORT)"
python3 - "$PROMETHEUS_PORT" <<'EOF'
import json, sys, time, urllib.request
port = sys.argv[1]
wanted = {"lattice-scheduler", "lattice-gateway"}
deadline = time.monotonic() + 60
while True:
    answer = json.load(urllib.request.urlopen(
        f"http://127.0.0.1:{port}/api/v1/targets?state=active", timeout=10))
    health = {t["labels"]["job"]: (t["health"], t.get("lastError", ""))
              for t in answer["data"]["activeTargets"]}
    if all(health.get(job, ("",))[0] == "up" for job in wanted):
        break
    if time.monotonic() > deadline:
        sys.exit(f"targets not up: {health}")
    time.sleep(2)
print("targets:", ", ".join(f"{job} {state}" for job, (state, _) in sorted(health.items())))
EOF

phase "grafana: no Debian package, not started (tests/stack checks its provisioning files)"
