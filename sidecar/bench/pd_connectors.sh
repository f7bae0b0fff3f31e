#!/usr/bin/env bash
# kvgate-sidecar P/D connectors: the same two kvgate-sim engines (a prefill one and a decode one,
# both able to play vLLM's NIXL and SGLang's bootstrap roles) behind two sidecars, one with
# --kv-connector nixlv2 and one with --kv-connector sglang, measured alternately with wrk at
# concurrency 1 and 8 (docs/benchmarks.md § sidecar P/D connectors). The sims run at
# --time-scale 1000 so model time is small; requests are sidecar/bench/pd_load.lua's (256-byte
# prompt, max_tokens 4, non-streaming, a distinct prompt each).
#
#   sidecar/bench/pd_connectors.sh [seconds-per-run] [rounds]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
secs=${1:-10}
rounds=${2:-3}
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -p kvgate-e2e --bin kvgate-sim >/dev/null
cargo build --release -p kvgate-sidecar --bin kvgate-sidecar >/dev/null
pre=18251 boot=18252 dec=18253 nixl=18254 nixl_h=18255 sgl=18256 sgl_h=18257
export RUST_LOG=warn
list=$(mktemp); echo "127.0.0.1:$pre" > "$list"
log=$(mktemp)  # the processes' warnings (no NATS here, so the sidecars' bridges complain)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -f "$list" "$log"' EXIT
sim() { taskset -c 0 "$target/release/kvgate-sim" --host 127.0.0.1 --model sim --max-waiting 0 \
  --max-num-seqs 256 --time-scale 1000 "$@" 2>>"$log" & pids+=($!); }
sim --port $pre --pod-name prefill-0 --disaggregation-mode prefill --disaggregation-bootstrap-port $boot
sim --port $dec --pod-name decode-0 --disaggregation-mode decode
sidecar() { taskset -c 0 "$target/release/kvgate-sidecar" --engine-url "http://127.0.0.1:$dec" \
  --model sim --pool bench --pod decode-0 --prefiller-allow-list "$list" "$@" 2>>"$log" & pids+=($!); }
sidecar --proxy-port $nixl --metrics-port $nixl_h --kv-connector nixlv2
sidecar --proxy-port $sgl --metrics-port $sgl_h --kv-connector sglang --sglang-bootstrap-port $boot
for h in $nixl_h $sgl_h; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$h/ready" >/dev/null && break; sleep 0.1; done
  curl -sf "http://127.0.0.1:$h/ready" >/dev/null || { echo "sidecar on :$h not ready" >&2; exit 1; }
done

# Prints "p50_us p99_us req_per_s" for one wrk run.
run() {  # $1 port, $2 connections
  PD_PREFILLER="127.0.0.1:$pre" taskset -c 1 wrk -t1 -c"$2" -d"${secs}s" --latency \
    -s "$root/sidecar/bench/pd_load.lua" "http://127.0.0.1:$1" | awk '
      function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return (v+0)*1000; if (v ~ /s$/) return (v+0)*1e6; return v }
      $1 == "50%" { p50 = us($2) } $1 == "99%" { p99 = us($2) } $1 == "Requests/sec:" { rps = $2 }
      $0 ~ /non-200 responses: [1-9]/ { bad = 1 }
      END { if (bad) { print "non-200 responses" > "/dev/stderr"; exit 1 } printf "%.1f %.1f %.0f\n", p50, p99, rps }'
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-4s %-5s %11s %11s %11s %11s %9s %9s %9s\n" conc round p50_nixlv2 p50_sglang p99_nixlv2 p99_sglang rps_nixl rps_sgl p50_ratio
for c in 1 8; do
  for r in $(seq "$rounds"); do
    read -r n50 n99 nr < <(run $nixl "$c")
    read -r s50 s99 sr < <(run $sgl "$c")
    python3 -c "print(f'{$c:<4} {$r:<5} {$n50:>9.1f}us {$s50:>9.1f}us {$n99:>9.1f}us {$s99:>9.1f}us {$nr:>9} {$sr:>9} {$s50/$n50:>8.2f}x')"
  done
done
echo "the proxies' own time per P/D request (kvgate_sidecar_proxy_added_latency_seconds{mode=\"pd\"}: time to the response head minus upstream waits):"
for pair in "nixlv2 $nixl_h" "sglang $sgl_h"; do
  set -- $pair
  curl -s "http://127.0.0.1:$2/metrics" | awk -v c="$1" '
    /^kvgate_sidecar_proxy_added_latency_seconds_sum\{mode="pd"/ { s = $2 }
    /^kvgate_sidecar_proxy_added_latency_seconds_count\{mode="pd"/ { n = $2 }
    /^kvgate_sidecar_proxy_prefill_failures_total/ { f += $2 }
    END { printf "%s: %d requests, mean %.1f us, prefill failures %d\n", c, n, (n ? s / n * 1e6 : 0), f }'
done
echo "rooms joined by the decode sim: $(curl -s "http://127.0.0.1:$dec/metrics" | awk '/^kvgate_sim_bootstrap_rooms_joined_total/ { print $2 }')"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
