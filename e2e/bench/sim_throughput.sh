#!/usr/bin/env bash
# kvgate-sim throughput benchmark: one simulator process pinned to one core (time-scale 1),
# load from wrk on the other core. Prints req/s for short requests and stream behaviour at 200
# concurrent streams, as recorded in docs/benchmarks.md.
#
#   e2e/bench/sim_throughput.sh [duration-seconds]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
secs=${1:-15}
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -p kvgate-e2e --bin kvgate-sim >/dev/null
sim="$target/release/kvgate-sim"
port=18231
run_sim() {
  export RUST_LOG=warn
  taskset -c 0 "$sim" --host 127.0.0.1 --port $port --model sim --max-waiting 0 "$@" &
  pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return; sleep 0.1; done
  echo "kvgate-sim did not start" >&2; exit 1
}
stop_sim() { kill "$pid"; wait "$pid" 2>/dev/null || true; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$pid/stat"; }
report() {  # $1: ticks at start, $2: wall seconds
  local used=$(( $(cpu_ticks) - $1 )) hz; hz=$(getconf CLK_TCK)
  local lag_sum lag_n lag_max
  lag_sum=$(metric kvgate_sim_step_lag_seconds_sum); lag_n=$(metric kvgate_sim_step_lag_seconds_count)
  lag_max=$(metric kvgate_sim_step_lag_max_seconds)
  python3 -c "print(f'sim CPU: {$used/$hz/$2*100:.0f}% of one core; steps: {int($lag_n)}, mean delivery lag {$lag_sum/max($lag_n,1)*1000:.2f} ms, max {$lag_max*1000:.1f} ms')"
}
# awk reads the whole page: exiting at the first match would make curl fail with a write error
# (exit 23), which pipefail turns into this script's exit.
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v n="$1" '!done && ($1 ~ "^"n"[{ ]" || $1 == n) {print $2; done=1}'; }

echo "== short requests: 64-byte prompt, max_tokens 1, non-streaming, 256 connections, ${secs}s"
run_sim --max-num-seqs 256
t0=$(cpu_ticks)
SIM_MAX_TOKENS=1 taskset -c 1 wrk -t1 -c256 -d"${secs}s" -s "$root/e2e/bench/sim_load.lua" "http://127.0.0.1:$port" | grep -E "Requests/sec|Latency|non-200"
report "$t0" "$secs"
stop_sim

echo "== CPU ceiling: the same short requests at --time-scale 1000 (model time no longer limits), ${secs}s"
run_sim --max-num-seqs 256 --time-scale 1000
t0=$(cpu_ticks)
SIM_MAX_TOKENS=1 taskset -c 1 wrk -t1 -c256 -d"${secs}s" -s "$root/e2e/bench/sim_load.lua" "http://127.0.0.1:$port" | grep -E "Requests/sec|Latency|non-200"
report "$t0" "$secs"
stop_sim

echo "== 200 concurrent streams: max_tokens 64, streaming, ${secs}s"
run_sim --max-num-seqs 256
t0=$(cpu_ticks)
SIM_MAX_TOKENS=64 SIM_STREAM=1 taskset -c 1 wrk -t1 -c200 -d"${secs}s" -s "$root/e2e/bench/sim_load.lua" "http://127.0.0.1:$port" | grep -E "Requests/sec|Latency|non-200"
itl_sum=$(metric 'vllm:inter_token_latency_seconds_sum'); itl_n=$(metric 'vllm:inter_token_latency_seconds_count')
report "$t0" "$secs"
echo "mean ITL reported by the sim (model time): $(python3 -c "print(f'{$itl_sum/$itl_n*1000:.2f} ms over {int($itl_n)} gaps')")"
stop_sim
