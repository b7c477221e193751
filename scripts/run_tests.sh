#!/usr/bin/env bash
# Runs the whole test suite. Starts the servers the tests need when they are not running:
# etcd (a private instance on free ports, Debian package etcd-server) and NATS on 127.0.0.1:4222.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
cleanup() { [ -n "${ETCD_PID:-}" ] && kill "$ETCD_PID" 2>/dev/null || true; [ -n "${NATS_PID:-}" ] && kill "$NATS_PID" 2>/dev/null || true; }
trap cleanup EXIT

if ! command -v etcd >/dev/null 2>&1; then
  echo "etcd not found: installing Debian's etcd-server" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null
fi
if [ -z "${TURBINE_TEST_ETCD:-}" ]; then
  read -r CPORT PPORT < <($PY -c 'import socket
ss=[socket.socket() for _ in range(2)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(*[s.getsockname()[1] for s in ss])')
  ETCD_DIR=$(mktemp -d)
  etcd --name turbine-test --data-dir "$ETCD_DIR" --listen-client-urls "http://127.0.0.1:$CPORT" \
       --advertise-client-urls "http://127.0.0.1:$CPORT" --listen-peer-urls "http://127.0.0.1:$PPORT" \
       --initial-advertise-peer-urls "http://127.0.0.1:$PPORT" \
       --initial-cluster "turbine-test=http://127.0.0.1:$PPORT" >"$ETCD_DIR/etcd.log" 2>&1 &
  ETCD_PID=$!
  export TURBINE_TEST_ETCD="127.0.0.1:$CPORT"
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  if ! command -v nats-server >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server) >/dev/null
  fi
  nats-server -a 127.0.0.1 -p 4222 >/tmp/turbine-test-nats.log 2>&1 &
  NATS_PID=$!
fi
export TURBINE_TEST_NATS="nats://127.0.0.1:4222"

start=$(date +%s)
$PY -m pytest tests -q -p no:cacheprovider "$@"
echo "make test took $(( $(date +%s) - start ))s"
