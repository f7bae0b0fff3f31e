#!/usr/bin/env bash
# Latency Envoy+EPP adds over Envoy routing directly, and EPP CPU per request, in one run:
# one Envoy with two listeners ("direct" and "epp") in front of the same kvgate-sim, the EPP
# (release build, real Qwen3 tokenizer when bootstrapped) on the "epp" listener's ext_proc, and
# wrk alternating between the two listeners. Figures go to docs/benchmarks.md.
#
#   e2e/bench/envoy_overhead.sh [seconds-per-run]      (default 10)
#
# Cases: 8 KB and 220 KB bodies at concurrency 1 and 150 (direct vs epp), then EPP CPU per
# request with ~100k-token prompts at concurrency 8, multi-turn (shared history, new last turn)
# and cold (every prompt new).
#
# Environment, to iterate on one case or compare builds:
#   CASES="8192:1 225280:150"  body:concurrency pairs to run (default: all four)
#   CPU=0                      skip the CPU-per-request section
#   EPP_BIN=path               run this kvgate-epp binary instead of building one (e.g. a kept
#                              baseline build, to compare before/after in one session)
#   EPP_ARGS="..."             extra kvgate-epp arguments
#   PIN=epp | gateway          taskset: the EPP (epp), or Envoy and the EPP (gateway), on the last
#                              CPU and the rest on the others, as their own pods or nodes would
#                              be in a cluster. Without it all share every core, so at
#                              saturation any CPU the EPP uses shows up as queueing in the sim
#   SIM_ARGS="..."             extra kvgate-sim arguments
#   SIM_PREFIX_CACHING=1       keep the sim's prefix caching on (off by default here, see below)
#   ACCESS_LOG=1               print, per case and listener, where requests spent their time:
#                              received, to_upstream (ext_proc and routing), upstream,
#                              response_headers, sent, total (Envoy COMMON_DURATION, µs)
#   RESPONSE=off               diagnosis only: Envoy skips the response phase (headers, body,
#                              trailers) on the ext_proc stream, to measure that phase's share
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
secs=${1:-10}
target=${CARGO_TARGET_DIR:-$root/target}
# PIN=epp: the EPP alone on the last CPU, everything else on the rest. PIN=gateway: Envoy and
# the EPP on the last CPU, the sim and wrk on the rest.
epp_pin=(); envoy_pin=(); rest_pin=()
case "${PIN:-}" in
  "") ;;
  epp|gateway)
    last=$(( $(nproc) - 1 ))
    [ "$last" -ge 1 ] || { echo "PIN=$PIN needs at least 2 CPUs"; exit 2; }
    epp_pin=(taskset -c "$last"); rest_pin=(taskset -c "0-$(( last - 1 ))")
    envoy_pin=("${rest_pin[@]}")
    [ "$PIN" = gateway ] && envoy_pin=("${epp_pin[@]}") ;;
  *) echo "PIN must be epp or gateway, not '$PIN'"; exit 2 ;;
esac
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install -y wrk)"; exit 2; }
# One package per build: built together, feature unification recompiles the EPP's whole
# dependency tree (k8s-openapi included) with the simulator's features.
cargo build -q --release -p kvgate-e2e --bin kvgate-sim
if [ -z "${EPP_BIN:-}" ]; then
  cargo build -q --release -p kvgate-epp --bin kvgate-epp
  EPP_BIN="$target/release/kvgate-epp"
fi
cases=${CASES:-8192:1 8192:150 225280:1 225280:150}
envoy=$(ls "$root"/.venv/lib/python3*/site-packages/envoy/_bin/envoy)
tok="$root/.cache/tokenizers/qwen3/package/models"
run=$(mktemp -d /tmp/kvgate-overhead.XXXXXX)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

sim=$(port)
# Every latency case's prompt is new, so the sim's prefix cache never hits there; hashing each
# prompt's blocks only costs the sim CPU (a 220 KB prompt is ~3,400 SHA-256 block hashes) on
# the cores it shares with Envoy and the EPP. SIM_PREFIX_CACHING=1 turns it back on.
sim_cache=(--no-enable-prefix-caching)
[ "${SIM_PREFIX_CACHING:-0}" = 1 ] && sim_cache=()
RUST_LOG=warn "${rest_pin[@]}" "$target/release/kvgate-sim" --host 127.0.0.1 --port "$sim" --model m --time-scale 1000 \
  --max-num-seqs 512 --max-waiting 0 --max-model-len 1000000 --num-gpu-blocks-override 400000 \
  --max-num-batched-tokens 1000000 "${sim_cache[@]}" ${SIM_ARGS:-} > "$run/sim.log" 2>&1 &
pids+=($!)
printf 'endpoints:\n  - {name: sim-0, address: 127.0.0.1, ports: [%s]}\n' "$sim" > "$run/endpoints.yaml"
ext=$(port); health=$(port); metrics=$(port); direct=$(port); epp=$(port); admin=$(port)
tokargs=()
[ -f "$tok/tokenizer.json" ] && tokargs=(--tokenizer-dir "$tok")
read -r -a extra <<<"${EPP_ARGS:-}"
RUST_LOG=warn "${epp_pin[@]}" "$EPP_BIN" --pool-name bench --discovery file --endpoints-file "$run/endpoints.yaml" \
  --plaintext --grpc-port "$ext" --grpc-health-port "$health" --metrics-port "$metrics" --model m \
  "${tokargs[@]}" "${extra[@]}" > "$run/epp.log" 2>&1 &
epp_pid=$!; pids+=($epp_pid)
# ACCESS_LOG=1: each listener logs, per request, where its time went (µs): downstream request
# received, ext_proc + routing until the upstream request starts, upstream, response relayed.
alog() {
  if [ "${ACCESS_LOG:-0}" = 1 ]; then
    printf '[{name: envoy.access_loggers.file, typed_config: {"@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", path: "%s", log_format: {text_format_source: {inline_string: "%%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%% %%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%% %%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%% %%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%% %%COMMON_DURATION(DS_TX_BEG:DS_TX_END:us)%% %%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%%\\\\n"}}}}]' "$run/access-$1.log"
  else
    printf '[]'
  fi
}
sed -e "s/@ADMIN@/$admin/; s/@DIRECT@/$direct/; s/@EPP@/$epp/; s/@EXTPROC@/$ext/; s/@SIM@/$sim/g" \
  -e "s|@ACCESS_LOG_DIRECT@|$(alog direct)|; s|@ACCESS_LOG_EPP@|$(alog epp)|" \
  "$root/e2e/bench/envoy_overhead.yaml.in" > "$run/envoy.yaml"
if [ "${RESPONSE:-on}" = off ]; then
  sed -i -e 's/response_header_mode: SEND/response_header_mode: SKIP/; s/response_body_mode: FULL_DUPLEX_STREAMED/response_body_mode: NONE/; s/response_trailer_mode: SEND/response_trailer_mode: SKIP/' "$run/envoy.yaml"
fi
"${envoy_pin[@]}" "$envoy" -c "$run/envoy.yaml" --log-level warn --concurrency 1 > "$run/envoy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$epp/v1/models" && break; sleep 0.2; done

# wrk: $1 port, $2 connections, $3 body bytes, $4 history(0/1), $5 seconds → "RESULT …" line.
# Every invocation gets its own RUN number (kept in a file: load runs in subshells), so no run
# replays the prompts of the warm-up before it.
load() {
  local n; n=$(( $(cat "$run/wrk-runs" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$run/wrk-runs"
  RUN=$n BODY_BYTES=$3 HISTORY=$4 "${rest_pin[@]}" wrk -t"$(( $2 < 2 ? 1 : 2 ))" -c"$2" -d"${5:-$secs}s" --latency --timeout 60s \
    -s "$root/e2e/bench/overhead.lua" "http://127.0.0.1:$1" 2>&1 | grep '^RESULT' || echo "RESULT failed"
}
# ACCESS_LOG=1: p50 / p99 (µs) of each phase over a listener's log lines after line $2.
phases() {
  [ "${ACCESS_LOG:-0}" = 1 ] || return 0
  sleep 1.2 # Envoy flushes access logs every second
  tail -n +"$(( $2 + 1 ))" "$run/access-$1.log" | python3 -c '
import sys
rows = [l.split() for l in sys.stdin if l.strip()]
out = []
for i, name in enumerate(["received", "to_upstream", "upstream", "response_headers", "sent", "total"]):
    v = sorted(int(r[i]) for r in rows if len(r) > i and r[i] != "-")
    if v:
        out.append(f"{name} {v[len(v) // 2]}/{v[min(len(v) - 1, len(v) * 99 // 100)]}")
print("  phases (us, p50/p99): " + "  ".join(out))'
}
lines() { [ "${ACCESS_LOG:-0}" = 1 ] && { sleep 1.2; wc -l < "$run/access-$1.log"; } || echo 0; }
field() { sed -n "s/.*$1=\([0-9]*\).*/\1/p" <<<"$2"; }
echo "machine: $(nproc) cores, $(uname -r); envoy --concurrency 1; sim --time-scale 1000 ${sim_cache[*]} ${SIM_ARGS:-}; pinned: ${PIN:-no}"
echo "tokenizer: ${tokargs[*]:-byte fallback}; ${secs}s per run; warm-up 3s per case"
echo "epp: $EPP_BIN ${EPP_ARGS:-}; response phase ${RESPONSE:-on}; text ${TEXT:-random}; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-8s %-4s %-7s %9s %9s %9s %9s %9s %9s %8s\n' body conc path p50_ms p99_ms reqs added_p50 added_p99 non2xx
for case in $cases; do
  size=${case%%:*}; conc=${case##*:}
  {
    load "$direct" "$conc" "$size" 0 3 >/dev/null; load "$epp" "$conc" "$size" 0 3 >/dev/null
    ld=$(lines direct); le=$(lines epp)
    d=$(load "$direct" "$conc" "$size" 0); e=$(load "$epp" "$conc" "$size" 0)
    for which in direct epp; do
      r=$([ $which = direct ] && echo "$d" || echo "$e")
      p50=$(field p50_us "$r"); p99=$(field p99_us "$r")
      add50=""; add99=""
      if [ $which = epp ]; then
        add50=$(python3 -c "print(f'{($(field p50_us "$e")-$(field p50_us "$d"))/1000:.2f}')")
        add99=$(python3 -c "print(f'{($(field p99_us "$e")-$(field p99_us "$d"))/1000:.2f}')")
      fi
      printf '%-8s %-4s %-7s %9s %9s %9s %9s %9s %8s\n' "$size" "$conc" "$which" \
        "$(python3 -c "print(f'{${p50:-0}/1000:.2f}')")" "$(python3 -c "print(f'{${p99:-0}/1000:.2f}')")" \
        "$(field requests "$r")" "$add50" "$add99" "$(field non2xx "$r")"
      phases "$which" "$([ $which = direct ] && echo "$ld" || echo "$le")"
    done
  }
done

finisher() {
  curl -s "http://127.0.0.1:$metrics/metrics" | awk '/^kvgate_epp_(prompts_finish|background_tokenized)/ {printf "%s=%s ", $1, $2}
    /^kvgate_epp_decision_seconds_total/ {d=$2} /^kvgate_epp_requests_routed_total/ {n=$2}
    END {if (n > 0) printf "mean decision %.3f ms over %d requests", d/n*1000, n; print ""}'
  echo "EPP CPU so far: $(awk -v hz="$(getconf CLK_TCK)" '{printf "%.1f s", ($14+$15)/hz}' "/proc/$epp_pid/stat")"
  # By thread name: the request path (tokio workers) versus background work.
  echo "  by thread: $(for t in /proc/"$epp_pid"/task/*; do printf '%s %s\n' "$(cat "$t/comm")" \
    "$(sed 's/.*) //' "$t/stat" | awk '{print $12+$13}')"; done | awk -v hz="$(getconf CLK_TCK)" \
    '{c[$1]+=$2} END {for (n in c) if (c[n] > 0) printf "%s %.2f s; ", n, c[n]/hz}')"
}
finisher
echo "envoy: $(curl -s "http://127.0.0.1:$admin/stats" | awk -F': ' '/^cluster\.(direct|pool|ext_proc)\.(upstream_cx_total|upstream_rq_total):/ {printf "%s=%s ", $1, $2}')"
[ "${CPU:-1}" = 0 ] && { echo "logs in $run"; exit 0; }
# EPP CPU per request, ~100k-token prompts (≈ 560 KB of text with the Qwen3 tokenizer).
ticks() { awk '{print $14+$15}' "/proc/$epp_pid/stat"; }
hz=$(getconf CLK_TCK)
for hist in 1 0; do
  label=$([ $hist = 1 ] && echo "multi-turn (shared history)" || echo "cold (every prompt new)")
  load "$epp" 8 573440 "$hist" 3 >/dev/null
  t0=$(ticks); r=$(load "$epp" 8 573440 "$hist"); t1=$(ticks)
  n=$(field requests "$r")
  python3 -c "n=max(${n:-0},1); cpu=($t1-$t0)/$hz; print(f'100k-token prompts, {\"$label\"}: {n} requests, EPP CPU {cpu:.2f} s, {cpu/n*1000:.2f} ms = {cpu/n:.4f} core*s per request; p50 {$(field p50_us "$r")/1000:.1f} ms, p99 {$(field p99_us "$r")/1000:.1f} ms')"
done
finisher
m=$(curl -s "http://127.0.0.1:$metrics/metrics")
echo "EPP decisions: $(echo "$m" | awk '/^kvgate_epp_requests_routed_total/ {print $2}') routed; keys exact $(echo "$m" | awk '/^kvgate_epp_keys_exact_total/ {print $2}')"
echo "logs in $run"
