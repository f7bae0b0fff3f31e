#!/usr/bin/env bash
# TTFT with the node's KV block manager vs without, live and in the replay
# (docs/benchmarks.md § "The block manager in the data path").
#
# The Mooncake conversation trace on N `small` kvgate-sim engines whose GPU caches are far
# smaller than the working set (--num-gpu-blocks), through Envoy + kvgate-epp (kv policy), on
# fresh release stacks: without the block manager; with it, host memory only (once per size in
# HOST_GIBS); with it, a small host memory and a large disk. Then the same configurations in
# the replay (`kvgate-bench replay --kvbm-host-gib/--kvbm-disk-gib`), its prediction.
#
# The default sizes are a node's share for 4 GPUs: a DGX H100 has 2 TiB of memory and 30 TB
# of NVMe for 8, so 1 TiB of host memory is half its memory; 256 GiB shows a smaller node.
#
# The real KV volume (2 MiB per block) is more than a two-core machine can copy at the trace's
# rate, so live blocks carry PAYLOAD bytes (`kvgate-sim --kvbm-payload-bytes`): the engines
# still charge loads at the real block size, and the daemon's budgets are scaled to hold the
# same number of blocks as the real sizes below (GiB of 2 MiB blocks). Redis gets no budget
# (the replay models no remote tier).
#
#   e2e/bench/kvbm_ttft.sh [engines] [trace-seconds] [speedup]
# Environment: CARGO_TARGET_DIR; TIME_SCALE (1: real time; 2 halves the wall time, but the
# gateway's wall-time delays then count double in model time, which changes the order in which
# a burst's requests reach the engines: docs/benchmarks.md); GPU_BLOCKS (8300); PAYLOAD (16384);
# HOST_GIBS ("256 1024": the host-only runs; set but empty skips them); SMALL_HOST_GIB (128)
# and DISK_GIB (2048) (host + disk; DISK_GIB=0 skips it); OUT (a temp directory: records and
# logs).
#
# Each live row also gives the engines' own TTFT p50 ("engine p50": model time from a request's
# arrival at its engine to its first token, from the simulators' per-request debug lines), so
# the gateway's share of the client's TTFT (Envoy, the EPP, the sidecar, HTTP) shows apart from
# the engines' and the replay's, which model no gateway.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
engines=${1:-4}
trace_s=${2:-600}
speedup=${3:-1}
scale=${TIME_SCALE:-1}
gpu_blocks=${GPU_BLOCKS:-8300}
payload=${PAYLOAD:-16384}
host_gibs=${HOST_GIBS-256 1024}
small_host_gib=${SMALL_HOST_GIB:-128}
disk_gib=${DISK_GIB:-2048}
target=${CARGO_TARGET_DIR:-$root/target}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
cargo build --release -p kvgate-e2e -p kvgate-sidecar -p kvgate-epp -p kvgate-kvbm >/dev/null
bench="$target/release/kvgate-bench"
trace="$root/../shared/traces/mooncake_conversation_trace.jsonl"
max_len=$((gpu_blocks * 16 - 16))
# GiB of real 2 MiB blocks → MiB of PAYLOAD-byte blocks.
mib() { echo $(($1 * 512 * payload / 1048576)); }

engine_args=(--engine-arg=--num-gpu-blocks=$gpu_blocks --engine-arg=--max-model-len=$max_len)
live() { # $1 = label, rest = extra compare flags
  local label=$1
  shift
  echo "== live: $label" >&2
  "$bench" compare --engines "$engines" --preset small --time-scale "$scale" --policies kv \
    --loads "$speedup" --log-level warn,kvgate_sim::request=debug --run-dir "$out/run-$label" \
    --out "$out/live-$label" "${engine_args[@]}" "$@" \
    -- --workload mooncake --trace "$trace" --trace-to "$trace_s" --quiet \
    >"$out/live-$label.log" 2>&1 || { tail -30 "$out/live-$label.log" >&2; exit 1; }
  grep -E '^(run|kv) ' "$out/live-$label.log" | head -2 | sed "s/^kv /$label /"
  engine_p50 "$out/run-$label"
}
engine_p50() { # $1 = a stack's run dir: the median of its engines' per-request TTFT
  cat "$1"/engine-*.log | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'ttft_ms=[0-9][0-9.]*' | cut -d= -f2 |
    sort -n | awk '{v[NR] = $1} END {
      if (NR == 0) { print "engine p50: no per-request lines"; exit 1 }
      printf "engine p50 %.1f ms over %d requests\n", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2, NR }'
}
replay() { # $1 = label, rest = extra replay flags
  local label=$1
  shift
  "$bench" replay --workload mooncake --trace "$trace" --trace-seconds "$trace_s" \
    --engines "$engines" --preset small --policy kv --num-gpu-blocks "$gpu_blocks" \
    --max-model-len "$max_len" --speedup "$speedup" --out "$out/replay-$label.jsonl" "$@" \
    >"$out/replay-$label.log" 2>&1
  sed -n 2p "$out/replay-$label.log" | sed "s/^kv /$label /"
  grep -o 'kvbm: .*' "$out/replay-$label.log" || true
}

payload_arg=--engine-arg=--kvbm-payload-bytes=$payload
live none
for gib in $host_gibs; do
  live "host-${gib}g" --kvbm "$payload_arg" --kvbm-host-mib "$(mib "$gib")" --kvbm-remote-mib 0
done
if [ "$disk_gib" -gt 0 ]; then
  live host+disk --kvbm "$payload_arg" --kvbm-host-mib "$(mib "$small_host_gib")" \
    --kvbm-disk-mib "$(mib "$disk_gib")" --kvbm-remote-mib 0
fi
echo "== replay (prediction)"
replay none
for gib in $host_gibs; do
  replay "host-${gib}g" --kvbm-host-gib "$gib"
done
if [ "$disk_gib" -gt 0 ]; then
  replay host+disk --kvbm-host-gib "$small_host_gib" --kvbm-disk-gib "$disk_gib"
fi
echo "records and logs: $out"
