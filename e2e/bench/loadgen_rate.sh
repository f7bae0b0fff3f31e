#!/usr/bin/env bash
# kvgate-bench load's own request-rate ceiling: one kvgate-sim at --time-scale 1000 (model time no
# longer limits) pinned to core 0, the load generator pinned to core 1, short streamed requests
# (16-token prompts, 1 output token) in a closed loop. Prints the load generator's summary and the
# CPU each process used, as recorded in docs/benchmarks.md.
#
#   e2e/bench/loadgen_rate.sh [duration-seconds] [concurrency]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
secs=${1:-15}
conc=${2:-256}
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -p kvgate-e2e --bins >/dev/null
port=18241
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
RUST_LOG=warn taskset -c 0 "$target/release/kvgate-sim" --host 127.0.0.1 --port $port --model sim \
  --max-waiting 0 --max-num-seqs 256 --time-scale 1000 &
sim=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
s0=$(ticks $sim)
RUST_LOG=warn taskset -c 1 "$target/release/kvgate-bench" load --url "http://127.0.0.1:$port" \
  --workload shared-prefix --groups 10 --users-per-group 100 --questions-per-user 400 \
  --system-prompt-tokens 8 --question-tokens 8 --output-tokens 1 \
  --concurrency "$conc" --duration "$secs" --quiet --run loadgen-rate --out "$out/records.jsonl" &
gen=$!
g0=$(ticks $gen)
g_last=$g0
while kill -0 $gen 2>/dev/null; do g_last=$(ticks $gen 2>/dev/null || echo "$g_last"); sleep 0.5; done
wait $gen
s1=$(ticks $sim)
kill $sim; wait $sim 2>/dev/null || true
hz=$(getconf CLK_TCK)
python3 -c "print(f'loadgen CPU: {($g_last-$g0)/$hz/$secs*100:.0f}% of one core (sampled to its exit); sim CPU: {($s1-$s0)/$hz/$secs*100:.0f}% of one core; records: {sum(1 for _ in open(\"$out/records.jsonl\"))}')"
