#!/usr/bin/env bash
# kvgate-sidecar end-to-end relay latency and throughput (docs/benchmarks.md § sidecar relay,
# end to end): vLLM-format frames from a ZMQ publisher at controlled rates → the real sidecar
# binary (release, pinned to CPU 0) → a real nats-server → a NATS subscriber measuring arrival −
# send per frame; publisher, subscriber and nats-server share CPU 1 (sidecar/benches/relay_e2e.rs).
#
#   sidecar/bench/relay_e2e.sh [seconds-per-rate] [rates]
#   e.g. sidecar/bench/relay_e2e.sh 5 100000,250000,500000,1000000,1500000,2000000
# Environment: RELAY_REQUESTS, RELAY_BLOCKS (frame shape; default 8 x 4), RELAY_SIDECAR_CPU,
# RELAY_LOAD_CPU (default 0 and 1; empty = unpinned), CARGO_TARGET_DIR.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
export RELAY_SECS=${1:-${RELAY_SECS:-5}}
export RELAY_RATES=${2:-${RELAY_RATES:-100000,250000,500000,1000000,1500000,2000000}}
command -v taskset >/dev/null || { echo "taskset not found (util-linux)" >&2; exit 2; }
cargo bench -p kvgate-sidecar --bench relay_e2e
