#!/usr/bin/env bash
# End-to-end smoke of the routing path with real components: Envoy 1.40 (bootstrap venv) →
# kvgate-epp (file discovery, direct-ZMQ KV events) → three kvgate-sim engines.
# Asserts that a shared-prefix conversation sticks to the engine that holds its prefix (the
# engine reports cached tokens), that Envoy sends each request where the EPP picked, and that a
# malformed body is refused with 400 by the EPP.
#
#   e2e/smoke/run.sh          (builds the binaries in debug; CARGO_TARGET_DIR honoured)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
cargo build -q -p kvgate-e2e --bin kvgate-sim -p kvgate-epp --bin kvgate-epp
envoy=$(ls "$root"/.venv/lib/python3*/site-packages/envoy/_bin/envoy)
run=$(mktemp -d /tmp/kvgate-smoke.XXXXXX)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
: > "$run/endpoints.yaml.tmp"; echo "endpoints:" > "$run/endpoints.yaml.tmp"
declare -a sims
for i in 0 1 2; do
  http=$(port); pub=$(port); rep=$(port); sims[$i]=$http
  "$target/debug/kvgate-sim" --host 127.0.0.1 --port "$http" --model m --pod-name "sim-$i" --time-scale 10 \
    --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$pub\",\"replay_endpoint\":\"tcp://*:$rep\"}" \
    > "$run/sim-$i.log" 2>&1 &
  pids+=($!)
  echo "  - {name: sim-$i, address: 127.0.0.1, ports: [$http], events: \"tcp://127.0.0.1:$pub\", replay: \"tcp://127.0.0.1:$rep\"}" >> "$run/endpoints.yaml.tmp"
done
mv "$run/endpoints.yaml.tmp" "$run/endpoints.yaml"
ext=$(port); health=$(port); metrics=$(port); listen=$(port); admin=$(port)
RUST_LOG=info "$target/debug/kvgate-epp" --pool-name smoke --discovery file --endpoints-file "$run/endpoints.yaml" \
  --plaintext --grpc-port "$ext" --grpc-health-port "$health" --metrics-port "$metrics" --model m > "$run/epp.log" 2>&1 &
pids+=($!)
sed -e "s/@ADMIN@/$admin/; s/@LISTEN@/$listen/; s/@EXTPROC@/$ext/; s/@SIM0@/${sims[0]}/; s/@SIM1@/${sims[1]}/; s/@SIM2@/${sims[2]}/" \
  "$root/e2e/smoke/envoy.yaml.in" > "$run/envoy.yaml"
"$envoy" -c "$run/envoy.yaml" --log-level warn > "$run/envoy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
sleep 1
fail() { echo "SMOKE FAILED: $*"; echo "logs in $run"; exit 1; }
sys=$(python3 -c "print('You are a helpful assistant for the shared prefix smoke test. ' * 20)")
pods=(); cached=()
for i in $(seq 1 6); do
  body="{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"$sys\"},{\"role\":\"user\",\"content\":\"question $i\"}],\"max_tokens\":4,\"ignore_eos\":true}"
  code=$(curl -s -o "$run/body.json" -D "$run/hdr.txt" -w '%{http_code}' "http://127.0.0.1:$listen/v1/chat/completions" -H 'content-type: application/json' -d "$body")
  [ "$code" = 200 ] || fail "request $i: HTTP $code"
  pods+=("$(grep -i '^x-kvgate-pod:' "$run/hdr.txt" | tr -d '\r' | cut -d' ' -f2)")
  cached+=("$(python3 -c "import json;print(json.load(open('$run/body.json'))['usage']['prompt_tokens_details']['cached_tokens'])")")
  sleep 0.3
done
echo "pods:   ${pods[*]}"; echo "cached: ${cached[*]}"
for i in 1 2 3 4 5; do
  [ "${pods[$i]}" = "${pods[0]}" ] || fail "request $((i+1)) left the pod holding the prefix"
  [ "${cached[$i]}" -gt 0 ] || fail "request $((i+1)) got no cached tokens"
done
# Envoy sent every request to the EPP's first choice.
mismatch=$(grep '^ACCESS' "$run/envoy.log" | awk '{split($2,u,"="); split($3,p,"="); split(p[2],l,","); if (u[2]!=l[1]) n++} END {print n+0}')
[ "$mismatch" = 0 ] || fail "$mismatch requests did not go to the EPP's pick"
code=$(curl -s -o "$run/bad.json" -D "$run/badhdr.txt" -w '%{http_code}' "http://127.0.0.1:$listen/v1/chat/completions" -H 'content-type: application/json' -d '{not json')
[ "$code" = 400 ] || fail "malformed body: HTTP $code, expected 400"
grep -qi '^x-kvgate-drop-reason' "$run/badhdr.txt" || fail "400 without x-kvgate-drop-reason"
m=$(curl -s "http://127.0.0.1:$metrics/metrics")
routed=$(echo "$m" | awk '/^kvgate_epp_requests_routed_total/ {print $2}')
ratio=$(echo "$m" | awk '/^kvgate_epp_prefix_hit_ratio/ {print $2}')
events=$(echo "$m" | awk '/^kvgate_epp_kv_events_total/ {print $2}')
scrapes=$(echo "$m" | awk '/^kvgate_epp_engine_scrapes_total/ {print $2}')
echo "EPP metrics: routed=$routed prefix_hit_ratio=$ratio kv_events=$events engine_scrapes=$scrapes"
python3 -c "import sys; sys.exit(0 if float('${scrapes:-0}') > 0 else 1)" || fail "metrics: no engine scrapes"
[ "${routed:-0}" -ge 6 ] || fail "metrics: routed=$routed"
python3 -c "import sys; sys.exit(0 if float('${ratio:-0}') > 0.5 else 1)" || fail "metrics: prefix hit ratio $ratio"
echo "SMOKE OK (logs in $run)"
