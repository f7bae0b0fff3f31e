#!/usr/bin/env bash
# kvgate-sidecar proxy overhead: the same kvgate-sim upstream measured directly and through the
# sidecar's pass-through proxy, alternating, at concurrency 1 and 32 (docs/benchmarks.md §
# sidecar proxy). The sim runs at --time-scale 1000 so model time does not dominate; requests are
# e2e/bench/sim_load.lua's (64-byte prompt, max_tokens 1, non-streaming).
#
#   sidecar/bench/proxy_overhead.sh [seconds-per-run] [rounds]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
secs=${1:-10}
rounds=${2:-3}
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -p kvgate-e2e -p kvgate-sidecar --bin kvgate-sim --bin kvgate-sidecar >/dev/null
sim_port=18241 proxy_port=18242 health_port=18243
export RUST_LOG=warn
taskset -c 0 "$target/release/kvgate-sim" --host 127.0.0.1 --port $sim_port --model sim \
  --max-waiting 0 --max-num-seqs 256 --time-scale 1000 &
sim_pid=$!
taskset -c 0 "$target/release/kvgate-sidecar" --engine-url "http://127.0.0.1:$sim_port" \
  --proxy-port $proxy_port --metrics-port $health_port --model sim --pool bench --pod bench-0 &
sidecar_pid=$!
trap 'kill $sim_pid $sidecar_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$health_port/ready" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$health_port/ready" >/dev/null || { echo "sidecar not ready" >&2; exit 1; }

# Prints "p50_us p99_us req_per_s" for one wrk run.
run() {  # $1 port, $2 connections
  SIM_MAX_TOKENS=1 taskset -c 1 wrk -t1 -c"$2" -d"${secs}s" --latency -s "$root/e2e/bench/sim_load.lua" \
    "http://127.0.0.1:$1" | awk '
      function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return (v+0)*1000; if (v ~ /s$/) return (v+0)*1e6; return v }
      $1 == "50%" { p50 = us($2) } $1 == "99%" { p99 = us($2) } $1 == "Requests/sec:" { rps = $2 }
      $0 ~ /non-200 responses: [1-9]/ { bad = 1 }
      END { if (bad) { print "non-200 responses" > "/dev/stderr"; exit 1 } printf "%.1f %.1f %.0f\n", p50, p99, rps }'
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-4s %-5s %10s %10s %10s %10s %10s %12s\n" conc round p50_direct p50_proxy p50_delta p99_direct p99_proxy p50_ratio
for c in 1 32; do
  for r in $(seq "$rounds"); do
    read -r d50 d99 _ < <(run $sim_port "$c")
    read -r p50 p99 _ < <(run $proxy_port "$c")
    python3 -c "print(f'{$c:<4} {$r:<5} {$d50:>8.1f}us {$p50:>8.1f}us {$p50-$d50:>8.1f}us {$d99:>8.1f}us {$p99:>8.1f}us {$p50/$d50:>11.2f}x')"
  done
done
echo "proxy's own added-latency histogram (time before the response head, upstream waits excluded):"
curl -s "http://127.0.0.1:$health_port/metrics" | grep -E '^kvgate_sidecar_proxy_added_latency_seconds_(sum|count)\{mode="passthrough"' 
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
