#!/usr/bin/env bash
# geotrain quickstart: installs what is missing, builds, then trains the demo
# job (a byte-level GPT on the `fortunes` text) with a coordinator and three
# workers on this machine, showing live progress and the final status.
#
#   ./deploy/quickstart.sh            # the demo
#   JOB=deploy/jobs/fmnist-mlp.textproto WORKERS=2 ./deploy/quickstart.sh
#
# Every process it starts is stopped when it exits, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

JOB="${JOB:-deploy/jobs/gpt-tiny.textproto}"
WORKERS="${WORKERS:-3}"
BUILD_DIR="${GEOTRAIN_BUILD_DIR:-build}"
RUN_DIR="${RUN_DIR:-$(mktemp -d /tmp/geotrain-quickstart.XXXXXX)}"
BIN="$BUILD_DIR/bin"

echo "== installing dependencies (skipped when present)"
./deploy/install-deps.sh
echo "== building (incremental)"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD_DIR" -j2 --target geotrain-coordinator geotrain-worker geotrain-ctl \
  | grep -E "error|warning|Built target" || true

PIDS=()
cleanup() {
  trap - EXIT INT TERM
  if [ ${#PIDS[@]} -gt 0 ]; then
    kill "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do
      alive=0
      for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.1
    done
    kill -9 "${PIDS[@]}" 2>/dev/null || true
  fi
  echo "logs and state: $RUN_DIR"
}
trap cleanup EXIT
trap 'echo; echo "interrupted"; exit 130' INT TERM

echo "== starting the coordinator ($JOB, $WORKERS workers); logs in $RUN_DIR"
"$BIN/geotrain-coordinator" --listen=127.0.0.1:0 --port_file="$RUN_DIR/port" \
  --job="$JOB" --min_workers="$WORKERS" --state_dir="$RUN_DIR/state" \
  --metrics_listen=127.0.0.1:0 --http_listen=127.0.0.1:0 \
  --tensorboard_dir="$RUN_DIR/tensorboard" >"$RUN_DIR/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do [ -s "$RUN_DIR/port" ] && break; sleep 0.1; done
if [ ! -s "$RUN_DIR/port" ]; then
  echo "the coordinator did not start:"; cat "$RUN_DIR/coordinator.log"; exit 1
fi
COORDINATOR="127.0.0.1:$(cat "$RUN_DIR/port")"
echo "   coordinator at $COORDINATOR (TLS; its CA and admin credential in $RUN_DIR/state/tls)"
METRICS_URL=$(grep -o -m1 'metrics: http://[^ ]*' "$RUN_DIR/coordinator.log" | cut -d' ' -f2)
echo "   Prometheus metrics: $METRICS_URL (every worker's too, from its heartbeats)"
echo "   health: $BIN/geotrain-ctl health --target=$COORDINATOR --admin_credential=$RUN_DIR/state/tls/admin.credential"
ADMIN="--admin_credential=$RUN_DIR/state/tls/admin.credential"
# The status page asks for a viewer token (TLS is on); it reads it from the
# URL's fragment, which the browser never sends.
PAGE_URL=$(grep -o -m1 'status page: http://[^ ]*' "$RUN_DIR/coordinator.log" | cut -d' ' -f3)
VIEWER=$("$BIN/geotrain-ctl" token create --coordinator="$COORDINATOR" "$ADMIN" \
  --role=viewer --ttl=24h --name=quickstart-viewer)
echo "   status page: ${PAGE_URL}#token=$VIEWER"
echo "   live view in a terminal: $BIN/geotrain-ctl watch --coordinator=$COORDINATOR $ADMIN"
echo "   TensorBoard curves: tensorboard --logdir $RUN_DIR/tensorboard"

# A token for exactly these workers, valid for an hour. It carries the CA's
# fingerprint, so a worker needs nothing else to trust the coordinator.
TOKEN=$("$BIN/geotrain-ctl" token create --coordinator="$COORDINATOR" "$ADMIN" \
  --uses="$WORKERS" --ttl=1h --name=quickstart)
echo "   join token ${TOKEN:0:10}... (geotrain-ctl token create)"

for i in $(seq 0 $((WORKERS - 1))); do
  "$BIN/geotrain-worker" --coordinator="$COORDINATOR" --listen=127.0.0.1:0 \
    --device=auto --name="worker$i" --token="$TOKEN" >"$RUN_DIR/worker$i.log" 2>&1 &
  PIDS+=($!)
done

echo "== training (geotrain-ctl status --brief every 3 s)"
START=$(date +%s)
while true; do
  line=$("$BIN/geotrain-ctl" status --coordinator="$COORDINATOR" "$ADMIN" --brief 2>&1) || true
  echo "$line"
  case "$line" in *" done "*) break ;; esac
  for i in $(seq 1 $((${#PIDS[@]} - 1))); do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null && ! wait "${PIDS[$i]}"; then
      echo "worker$((i - 1)) failed; its log:"; tail -n 20 "$RUN_DIR/worker$((i - 1)).log"; exit 1
    fi
  done
  sleep 3
done

echo
echo "== final status"
"$BIN/geotrain-ctl" status --coordinator="$COORDINATOR" "$ADMIN"
METRICS="$RUN_DIR/state/metrics.jsonl"
first=$(grep -m1 '"loss"' "$METRICS" | sed 's/.*"loss":\([0-9.eE+-]*\).*/\1/')
last=$(grep -v '"eval"' "$METRICS" | tail -n 1 | sed 's/.*"loss":\([0-9.eE+-]*\).*/\1/')
echo
awk -v a="$first" -v b="$last" -v t="$(( $(date +%s) - START ))" \
  'BEGIN { printf "loss %.3f -> %.3f (%.0f%% lower) in %d s; metrics log: '"$METRICS"'\n", a, b, 100 * (1 - b / a), t }'
