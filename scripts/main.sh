#!/usr/bin/env bash
# The main job. It runs, on embedded defaults:
#   1. the local stack's demo: `kvgate-bench up` (NATS, three kvgate-sim engines behind
#      kvgate-sidecars, kvgate-epp, a real Envoy), a shared-prefix conversation through Envoy that
#      sticks to the engine holding its prefix with cached tokens, then Ctrl-C (e2e/stack_demo.sh);
#   2. the simulator's throughput benchmark (e2e/bench/sim_throughput.sh, needs wrk);
#   3. Envoy direct vs Envoy+EPP latency and EPP CPU per request (e2e/bench/envoy_overhead.sh);
#   4. the EPP decision cost at 8k tokens (cargo bench -p kvgate-epp --bench decision -- 8k);
#   5. the KV-event and prefix-index benchmarks in release.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
echo "== local stack demo (kvgate-bench up)"
e2e/stack_demo.sh --release
if ! command -v wrk >/dev/null 2>&1; then
  echo "main: installing wrk for the simulator benchmark"
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y -qq wrk >/dev/null; else sudo apt-get install -y -qq wrk >/dev/null; fi
fi
echo "== kvgate-sim throughput"
e2e/bench/sim_throughput.sh 10
echo "== Envoy+EPP overhead over Envoy direct, and EPP CPU per request"
e2e/bench/envoy_overhead.sh 8
echo "== EPP decision cost (8k-token chats)"
cargo bench -p kvgate-epp --bench decision -- 8k
echo "== KV-event and prefix-index benchmarks"
cargo bench -p kvgate-kv-events -p kvgate-kv-index
