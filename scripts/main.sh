#!/usr/bin/env bash
# The main job. Until `kvgate-bench up` lands (issue #7) it runs, on embedded defaults:
#   1. the routing demo: real Envoy → kvgate-epp → three kvgate-sim engines, a shared-prefix
#      conversation that sticks to the engine holding its prefix (e2e/smoke/run.sh);
#   2. the simulator's throughput benchmark (e2e/bench/sim_throughput.sh, needs wrk);
#   3. Envoy direct vs Envoy+EPP latency and EPP CPU per request (e2e/bench/envoy_overhead.sh);
#   4. the EPP decision cost at 8k tokens (cargo bench -p kvgate-epp --bench decision -- 8k);
#   5. the KV-event and prefix-index benchmarks in release.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
echo "== routing demo"
e2e/smoke/run.sh
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
