#!/usr/bin/env bash
# CRIU dump + restore of a plain running vLLM CPU worker (not checkpoint mode: the vLLM worker refuses
# it on CPU). Run under the engine lock without passing it on: flock -o /tmp/turbine-engine.lock bash $0
# CRIU: a 4.x build (Debian bookworm's 3.17.1 cannot start on kernel 6.13+); set CRIU=/path/to/criu.
CRIU=${CRIU:-criu}  # the criu on PATH unless told
set -u
cd "$(dirname "$0")/../.."
D=$(mktemp -d /tmp/vllm-criu.XXXX); mkdir -p $D/img
PORT=$(.venv/bin/python -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
export TURBINE_DISCOVERY_DIR=$D/disc VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1
setsid .venv/bin/python -m turbine.vllm --enforce-eager --max-model-len 2048 --max-num-seqs 16 --system-port $PORT </dev/null >$D/worker.log 2>&1 &
W=$!
T0=$(date +%s.%N)
for i in $(seq 1 300); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
T1=$(date +%s.%N); echo "cold start to ready: $(echo "$T1 - $T0" | bc) s"
pstree -p $W | head -5
grep -c io_uring /proc/$W/maps; for c in $(pgrep -P $W); do echo child $c io_uring: $(grep -c io_uring /proc/$c/maps); done
$CRIU dump -t $W -D $D/img -o dump.log -v4 --tcp-established --ext-unix-sk --network-lock skip --link-remap --file-locks 2>&1 | tail -3
grep -E "Error|Warn" $D/img/dump.log | head -15
if grep -q "Dumping finished successfully" $D/img/dump.log; then
  wait $W 2>/dev/null  # reap the dumped (killed) worker: its pid must be free for the restore
  sleep 2
  du -sh $D/img
  sleep 1
  T0=$(date +%s.%N)
  $CRIU restore -D $D/img -d -o restore.log -v4 --tcp-established --ext-unix-sk --network-lock skip --link-remap --file-locks --pidfile $D/pid 2>&1 | tail -3
  grep -E "Error" $D/img/restore.log | head -10
  ok=0; for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && ok=1 && break; sleep 0.25; done
  echo restored-healthy=$ok
  T1=$(date +%s.%N); echo "restore to ready: $(echo "$T1 - $T0" | bc) s"; curl -s http://127.0.0.1:$PORT/health; echo
  W=$(cat $D/pid 2>/dev/null || echo $W)
fi
kill $(pstree -p $W | grep -o "([0-9]*)" | tr -d "()") 2>/dev/null; sleep 3; kill -9 $(pstree -p $W | grep -o "([0-9]*)" | tr -d "()") 2>/dev/null
echo dir $D
