#!/usr/bin/env bash
# The local stack's demo: `kvgate-bench up --kvbm` (NATS, Redis and the KV block manager, three
# kvgate-sim engines behind kvgate-sidecars, kvgate-epp with file discovery, a real Envoy), a
# shared-prefix conversation
# through Envoy that sticks to the engine holding its prefix (the engine reports cached tokens),
# the EPP's metrics, then Ctrl-C (SIGINT) and a check that everything stopped.
#
#   e2e/stack_demo.sh [--release]     (CARGO_TARGET_DIR honoured)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
profile=debug; flag=()
if [ "${1:-}" = --release ]; then profile=release; flag=(--release); fi
target=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
# One package at a time: building them together unifies their dependencies' features and
# rebuilds what `cargo build -p <crate>` already built.
for pkg in kvgate-epp kvgate-sidecar kvgate-kvbm kvgate-e2e; do cargo build -q "${flag[@]}" -p "$pkg" --bins; done
out=$(mktemp /tmp/kvgate-stack-demo.XXXXXX)
"$target/$profile/kvgate-bench" up --engines 3 --kvbm --kvbm-disk-mib 256 > "$out" 2>"$out.err" &
up=$!
cleanup() { kill -INT "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; rm -f "$out" "$out.err"; }
trap cleanup EXIT
fail() { echo "DEMO FAILED: $*"; cat "$out" "$out.err" | tail -40; exit 1; }
for _ in $(seq 600); do grep -q 'OpenAI base URL' "$out" && break; kill -0 "$up" 2>/dev/null || fail "kvgate-bench up exited"; sleep 0.1; done
cat "$out"
base=$(awk '/OpenAI base URL/ {print $4}' "$out")
metrics=$(awk '/EPP metrics/ {print $3}' "$out")
[ -n "$base" ] || fail "no base URL"
sys=$(python3 -c "print('You are a helpful assistant for the local stack demo. ' * 30)")
history=""
echo "turn  pod    cached_tokens  prompt_tokens"
first=""
for turn in 1 2 3 4 5; do
  body=$(python3 -c "import json,sys; print(json.dumps({'model':'m','max_tokens':8,'ignore_eos':True,
    'messages':[{'role':'system','content':sys.argv[1]}]+json.loads(sys.argv[2] or '[]')+[{'role':'user','content':'turn %s: tell me more' % sys.argv[3]}]}))" \
    "$sys" "$history" "$turn")
  hdr=$(mktemp); resp=$(curl -s -D "$hdr" "$base/chat/completions" -H 'content-type: application/json' -d "$body")
  pod=$(grep -i '^x-kvgate-pod:' "$hdr" | tr -d '\r' | cut -d' ' -f2); rm -f "$hdr"
  read -r cached prompt answer < <(python3 -c "import json,sys; r=json.loads(sys.argv[1]); u=r['usage'];
print(u['prompt_tokens_details']['cached_tokens'], u['prompt_tokens'], json.dumps(r['choices'][0]['message']['content']))" "$resp")
  printf '%-5s %-6s %-14s %s\n' "$turn" "$pod" "$cached" "$prompt"
  [ -n "$first" ] || first=$pod
  if [ "$turn" -gt 1 ]; then
    [ "$pod" = "$first" ] || fail "turn $turn left $first for $pod"
    [ "$cached" -gt 0 ] || fail "turn $turn got no cached tokens"
  fi
  history=$(python3 -c "import json,sys; h=json.loads(sys.argv[1] or '[]'); h+= [{'role':'user','content':'turn %s: tell me more' % sys.argv[3]},{'role':'assistant','content':json.loads(sys.argv[2])}]; print(json.dumps(h))" "$history" "$answer" "$turn")
  sleep 0.2
done
m=$(curl -s "$metrics")
for name in kvgate_epp_requests_routed_total kvgate_epp_prefix_hit_ratio kvgate_epp_nats_envelopes_applied_total kvgate_epp_nats_sources; do
  echo "$name $(echo "$m" | awk -v n="$name" '$1 ~ "^"n"({|$)" {s+=$2} END {print s+0}')"
done
kvbm_metrics=$(grep -o 'kvbm: .*' "$out" | grep -o 'http://[^ ,]*/metrics')
[ -n "$kvbm_metrics" ] || fail "no kvbm line"
k=$(curl -s "$kvbm_metrics")
for name in kvgate_kvbm_nats_connected kvgate_kvbm_tier_capacity_bytes kvgate_kvbm_connections; do
  echo "$name $(echo "$k" | awk -v n="$name" '$1 ~ "^"n"({|$)" {s+=$2} END {print s+0}')"
done
[ "$(echo "$k" | awk '$1 == "kvgate_kvbm_nats_connected" {print $2}')" = 1 ] || fail "the block manager is not on NATS"
[ "$(echo "$k" | awk '$1 == "kvgate_kvbm_tier_capacity_bytes{tier=\"disk\"}" {print $2}')" = 268435456 ] || fail "the block manager has no 256 MiB disk tier"
run_dir=$(awk '/run dir/ {print $3}' "$out")
kill -INT "$up"; wait "$up" || fail "kvgate-bench up did not exit cleanly on Ctrl-C"
trap - EXIT
rm -f "$out" "$out.err"
echo "STACK DEMO OK (logs in $run_dir)"
