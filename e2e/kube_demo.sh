#!/usr/bin/env bash
# The Kubernetes demo: `kvgate-bench up --kube` installs the Helm chart into a local Kubernetes
# API server (kapi) and runs the chart's containers here (two kvgate-sim model-server pods with
# their sidecars, the EPP with Kubernetes discovery, NATS), with Envoy in front configured as
# Envoy AI Gateway would. Then: the pool and pods as kubectl sees them, a conversation through
# the gateway that sticks to the pod holding its prefix (cached tokens reported), that pod
# turned NotReady with kubectl (the next turns go elsewhere), the EPP's Kubernetes metrics, and
# Ctrl-C.
#
#   e2e/kube_demo.sh [--release]     (CARGO_TARGET_DIR honoured)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
profile=debug; flag=()
if [ "${1:-}" = --release ]; then profile=release; flag=(--release); fi
target=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
for pkg in kvgate-epp kvgate-sidecar kvgate-kvbm kvgate-e2e; do cargo build -q "${flag[@]}" -p "$pkg" --bins; done
kubectl="$root/.cache/kube/bin/kubectl"
[ -x "$kubectl" ] || { echo "no kubectl in .cache/kube/bin: run scripts/bootstrap.sh"; exit 1; }
out=$(mktemp /tmp/kvgate-kube-demo.XXXXXX)
"$target/$profile/kvgate-bench" up --kube --engines 2 > "$out" 2>"$out.err" &
up=$!
cleanup() { kill -INT "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; rm -f "$out" "$out.err" "$out.turn"; }
trap cleanup EXIT
fail() { echo "KUBE DEMO FAILED: $*"; cat "$out" "$out.err" | tail -40; exit 1; }
for _ in $(seq 900); do grep -q 'OpenAI base URL' "$out" && break; kill -0 "$up" 2>/dev/null || fail "kvgate-bench up --kube exited"; sleep 0.1; done
cat "$out"
base=$(awk '/OpenAI base URL/ {print $4}' "$out")
metrics=$(awk '/EPP metrics/ {print $3}' "$out")
export KUBECONFIG=$(awk '/kubeconfig:/ {print $2}' "$out")
[ -n "$base" ] && [ -n "$metrics" ] || fail "no base URL or metrics URL"
echo "--- kubectl -n llm get inferencepool,pods"
"$kubectl" -n llm get inferencepool,pods
sys=$(python3 -c "print('You are a helpful assistant for the Kubernetes demo. ' * 30)")
history=""
turn() { # n -> prints "pod cached prompt" and extends history
  local body hdr resp pod cached prompt answer
  body=$(python3 -c "import json,sys; print(json.dumps({'model':'m','max_tokens':8,'ignore_eos':True,
    'messages':[{'role':'system','content':sys.argv[1]}]+json.loads(sys.argv[2] or '[]')+[{'role':'user','content':'turn %s: tell me more' % sys.argv[3]}]}))" \
    "$sys" "$history" "$1")
  hdr=$(mktemp); resp=$(curl -s -D "$hdr" "$base/chat/completions" -H 'content-type: application/json' -d "$body")
  pod=$(grep -i '^x-kvgate-pod:' "$hdr" | tr -d '\r' | cut -d' ' -f2); rm -f "$hdr"
  read -r cached prompt answer < <(python3 -c "import json,sys; r=json.loads(sys.argv[1]); u=r['usage'];
print(u['prompt_tokens_details']['cached_tokens'], u['prompt_tokens'], json.dumps(r['choices'][0]['message']['content']))" "$resp")
  history=$(python3 -c "import json,sys; h=json.loads(sys.argv[1] or '[]'); h+= [{'role':'user','content':'turn %s: tell me more' % sys.argv[3]},{'role':'assistant','content':json.loads(sys.argv[2])}]; print(json.dumps(h))" "$history" "$answer" "$1")
  echo "$pod $cached $prompt"
}
echo "turn  pod            cached_tokens  prompt_tokens"
first=""
for n in 1 2 3; do
  turn "$n" > "$out.turn"; read -r pod cached prompt < "$out.turn"
  printf '%-5s %-14s %-14s %s\n' "$n" "$pod" "$cached" "$prompt"
  [ -n "$first" ] || first=$pod
  if [ "$n" -gt 1 ]; then
    [ "$pod" = "$first" ] || fail "turn $n left $first for $pod"
    [ "$cached" -gt 0 ] || fail "turn $n got no cached tokens"
  fi
  sleep 0.2
done
echo "--- kubectl: $first NotReady"
"$kubectl" -n llm patch pod "$first" --subresource=status --type=merge \
  -p '{"status":{"conditions":[{"type":"Ready","status":"False"},{"type":"ContainersReady","status":"False"}]}}' >/dev/null
sleep 0.5
for n in 4 5; do
  turn "$n" > "$out.turn"; read -r pod cached prompt < "$out.turn"
  printf '%-5s %-14s %-14s %s\n' "$n" "$pod" "$cached" "$prompt"
  [ "$pod" != "$first" ] || fail "turn $n still went to the NotReady pod $first"
done
m=$(curl -s "$metrics")
for name in kvgate_epp_requests_routed_total inference_pool_ready_pods kvgate_epp_endpoints kvgate_epp_kube_stale_seconds kvgate_epp_nats_envelopes_applied_total; do
  echo "$name $(echo "$m" | awk -v n="$name" '$1 ~ "^"n"({|$)" {s+=$2} END {print s+0}')"
done
[ "$(echo "$m" | awk '$1 ~ /^inference_pool_ready_pods/ {print $2}')" = 1 ] || fail "the EPP still counts the NotReady pod"
[ "$(echo "$m" | awk '$1 ~ /^kvgate_epp_nats_envelopes_applied_total/ {print ($2 > 0)}')" = 1 ] || fail "no KV-event envelopes reached the EPP"
run_dir=$(awk '/run dir/ {print $3}' "$out")
kill -INT "$up"; wait "$up" || fail "kvgate-bench up --kube did not exit cleanly on Ctrl-C"
trap - EXIT
rm -f "$out" "$out.err" "$out.turn"
echo "KUBE DEMO OK (logs in $run_dir)"
