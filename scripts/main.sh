#!/usr/bin/env bash
# The main job. Until the local stack lands (issue #7) it runs kvgate's benchmarks in release:
# KV-event decode + normalise throughput (and the prefix index when present).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
benches=(-p kvgate-kv-events)
if [ -d crates/kv-index ]; then benches+=(-p kvgate-kv-index); fi
cargo bench "${benches[@]}"
