#!/usr/bin/env bash
# Brings up one profile of deploy/compose/compose.yaml, waits until every service is healthy, asks
# the frontend for a chat completion, and takes the deployment down again (also on failure).
#   scripts/compose_smoke.sh mocker          # or agg, kv, disagg; builds the images if missing
# Environment: TURBINE_CLUSTER_KEY (made up when unset), TURBINE_HTTP_PORT (default 8000; e.g.
# 127.0.0.1:18000 to publish on loopback only), and the compose file's image variables.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:?usage: scripts/compose_smoke.sh agg|kv|disagg|mocker}
export TURBINE_CLUSTER_KEY=${TURBINE_CLUSTER_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
PORT=${TURBINE_HTTP_PORT:-8000}
URL="http://$([[ $PORT == *:* ]] && echo "$PORT" || echo "127.0.0.1:$PORT")"
compose() { docker compose -f deploy/compose/compose.yaml --profile "$PROFILE" "$@"; }
finish() {
  local rc=$?
  [ $rc -eq 0 ] || compose logs --no-color --tail 30 >&2 || true
  compose down --timeout 60 >/dev/null 2>&1 || true
  return $rc
}
trap finish EXIT

start=$(date +%s)
compose up --detach --wait --wait-timeout "${WAIT_TIMEOUT:-900}"
echo "[smoke] $PROFILE: every service healthy after $(( $(date +%s) - start )) s"
curl -fsS "$URL/health"; echo
# Over 300 prompt tokens: past --max-local-prefill-length (256), so a disaggregated deployment
# prefills it on the prefill worker and moves the KV to the decode worker.
PROMPT="$(printf 'The quick brown fox jumps over the lazy dog. %.0s' $(seq 30))Say hello."
curl -fsS "$URL/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"smollm2-135m-instruct\", \"max_tokens\": 16,
       \"messages\": [{\"role\": \"user\", \"content\": \"$PROMPT\"}]}"
echo
curl -fsS "$URL/metrics" | grep -E '^turbine_frontend_(prefills_total|cached_tokens_total)' || true
echo "[smoke] $PROFILE: answered"
