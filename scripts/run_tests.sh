#!/usr/bin/env bash
# Runs the whole test suite (TURBINE_TESTS=tests/unit: the unit tests alone, as `make test-unit`).
# Makes sure the servers the tests need are there: etcd (Debian's etcd-server; the tests start a private instance on free ports, or use $TURBINE_TEST_ETCD)
# and NATS on 127.0.0.1:4222 (started here when nothing listens there; the outage tests also
# start private nats-servers of their own, so the binary is needed either way), and Prometheus
# (Debian's prometheus: the planner's --prometheus-url test starts a private one, and the dashboard's
# queries are run on a real one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
cleanup() { [ -n "${NATS_PID:-}" ] && kill "$NATS_PID" 2>/dev/null || true; }
trap cleanup EXIT

if ! command -v etcd >/dev/null 2>&1; then
  echo "etcd not found: installing Debian's etcd-server" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null
fi
if ! command -v nats-server >/dev/null 2>&1; then
  echo "nats-server not found: installing Debian's nats-server" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server) >/dev/null
fi
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "prometheus not found: installing Debian's prometheus" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null
fi
if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  nats-server -a 127.0.0.1 -p 4222 >/tmp/turbine-test-nats.log 2>&1 &
  NATS_PID=$!
fi
export TURBINE_TEST_NATS="nats://127.0.0.1:4222"

# Turbine's own bytecode, written once: the suite starts about 300 Python processes (frontends, mockers,
# routers, planners, vLLM workers and their engine processes), each importing turbine/. Where
# PYTHONDONTWRITEBYTECODE is set (it is on the 2-core host of docs/operations/tests.md) each of them
# compiled it from source again: 0.3-0.4 s of CPU more per frontend or mocker start.
$PY -m compileall -q turbine tests >/dev/null

# Two pytest-xdist workers: the real-engine modules all on one of them, one after the other (the xdist
# groups of tests/conftest.py), everything else on the other meanwhile. TURBINE_TEST_WORKERS=0
# runs it all in this one process.
start=$(date +%s)
$PY -m pytest "${TURBINE_TESTS:-tests}" -q -p no:cacheprovider --durations=30 \
  -n "${TURBINE_TEST_WORKERS:-2}" --dist loadgroup "$@"
echo "make test took $(( $(date +%s) - start ))s"
