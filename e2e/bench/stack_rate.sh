#!/usr/bin/env bash
# Requests per second the live stack sustains through Envoy + EPP with short prompts
# (docs/benchmarks.md § "Live stack: requests per second"; issue #7's ≥ 500 req/s target).
#
# One release `kvgate-bench up` (NATS, N kvgate-sim engines at --time-scale 1000 so model time no
# longer limits, each behind a kvgate-sidecar, kvgate-epp with the kv policy, Envoy) and the load
# generator in a closed loop of short streamed chats (32-token shared system prompts in 10 groups,
# 16-token questions, 4 output tokens). Every process shares the machine's cores, as it would on a
# developer box. In the same run, as the baseline, the same load goes straight to engine 0's
# sidecar (no Envoy, no EPP). Prints both summaries and the CPU each component used.
#
#   e2e/bench/stack_rate.sh [seconds] [concurrency] [engines]
# Environment: CARGO_TARGET_DIR; STACK_RATE_POLICY (default kv).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
secs=${1:-20}
conc=${2:-64}
engines=${3:-3}
policy=${STACK_RATE_POLICY:-kv}
target=${CARGO_TARGET_DIR:-$root/target}
for p in kvgate-e2e kvgate-sidecar kvgate-epp; do
  cargo build --release -p "$p" >/dev/null
done
bench="$target/release/kvgate-bench"
out=$(mktemp -d)
run_dir="$out/stack"
cleanup() {
  [ -n "${up:-}" ] && kill "$up" 2>/dev/null && wait "$up" 2>/dev/null
  rm -rf "$out"
}
trap cleanup EXIT

RUST_LOG=warn "$bench" up --engines "$engines" --time-scale 1000 --policy "$policy" \
  --log-level warn --run-dir "$run_dir" --engine-arg=--max-num-seqs=256 >"$out/up.log" 2>&1 &
up=$!
url=""
for _ in $(seq 600); do
  url=$(sed -n 's/.*OpenAI base URL: *\(http[^ ]*\).*/\1/p' "$out/up.log" | head -1)
  [ -n "$url" ] && break
  kill -0 "$up" 2>/dev/null || { cat "$out/up.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "stack did not start" >&2; cat "$out/up.log" >&2; exit 1; }
sidecar_port=$(sed -n 's/.*name: sim-0, address: 127.0.0.1, ports: \[\([0-9]*\).*/\1/p' \
  "$run_dir/endpoints.yaml")

hz=$(getconf CLK_TCK)
ticks() { awk '{print $14+$15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
pids_of() { pgrep -f "$1" | tr '\n' ' '; }
sum_ticks() { local t=0; for p in $1; do t=$((t + $(ticks "$p"))); done; echo $t; }

load() { # $1 = label, $2 = url
  local groups=(epp envoy sidecar sim)
  local pats=("kvgate-epp " "envoy -c $run_dir" "kvgate-sidecar " "kvgate-sim ")
  declare -A before
  for i in "${!groups[@]}"; do before[${groups[$i]}]=$(sum_ticks "$(pids_of "${pats[$i]}")"); done
  local t0; t0=$(date +%s.%N)
  "$bench" load --url "$2" --workload shared-prefix --groups 10 --users-per-group 100 \
    --questions-per-user 400 --system-prompt-tokens 32 --question-tokens 16 --output-tokens 4 \
    --concurrency "$conc" --warmup 3 --duration "$secs" --drain 10 --quiet --run "$1" \
    --out "$out/$1.jsonl" &
  local gen=$!
  local g0; g0=$(ticks $gen)
  local g_last=$g0
  while kill -0 $gen 2>/dev/null; do g_last=$(ticks $gen); sleep 0.5; done
  wait $gen
  local t1; t1=$(date +%s.%N)
  local wall; wall=$(python3 -c "print($t1-$t0)")
  local cpu="loadgen $(python3 -c "print(f'{($g_last-$g0)/$hz/$wall:.2f}')")"
  for i in "${!groups[@]}"; do
    local after; after=$(sum_ticks "$(pids_of "${pats[$i]}")")
    cpu="$cpu, ${groups[$i]} $(python3 -c "print(f'{($after-${before[${groups[$i]}]})/$hz/$wall:.2f}')")"
  done
  python3 - "$out/$1.jsonl" "$1" "$secs" "$cpu" <<'EOF'
import json, sys
path, label, secs, cpu = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
recs = [json.loads(l) for l in open(path)]
t0 = min(r["start_ms"] for r in recs)
# the measured window: after the 3 s warm-up, for `secs` seconds of request starts
win = [r for r in recs if 3000 <= r["start_ms"] - t0 < 3000 + secs * 1000]
ok = [r for r in win if r["status"] == "ok"]
e2e = sorted(r["e2e_ms"] for r in ok)
q = lambda p: e2e[min(len(e2e) - 1, int(p * len(e2e)))] if e2e else float("nan")
print(f"{label}: {len(ok) / secs:.0f} req/s ok ({len(win) - len(ok)} not ok of {len(win)}), "
      f"e2e p50 {q(0.5):.1f} ms p99 {q(0.99):.1f} ms; CPU cores: {cpu}")
EOF
}
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); engines $engines, concurrency $conc, policy $policy, $secs s"
load envoy-epp "$url"
load direct-sidecar "http://127.0.0.1:$sidecar_port"
