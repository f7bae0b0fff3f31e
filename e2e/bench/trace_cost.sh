#!/usr/bin/env bash
# What request tracing costs a routing decision, measured with the decision bench
# (`epp/benches/decision.rs`: ~8k-token chats, the real Qwen3 tokenizer, 64 endpoints) in its
# A/B mode: one process holds the EPP's subscriber with tracing off and the one exporting over
# OTLP/gRPC (to an in-process receiver), and consecutive requests alternate between them. The
# figure is the median, over the pairs of neighbouring requests, of the traced request's extra
# thread CPU, as a share of the untraced p50; each configuration runs `runs` times and the
# median run is reported.
#
#   e2e/bench/trace_cost.sh [runs]        (default 5; a run takes ~10 s)
#
# Configurations:
#   default   requests without trace context, the default head sampling (10%): what a
#             deployment with tracing on pays on average
#   all       every request sampled (a caller's sampled traceparent): what one traced request pays
#   spans     the spans alone: a one-block chat on a one-endpoint pool, every request sampled
# The target (TARGET, default 5%) holds for both: exits 1 when the default or the all
# configuration's warm 8k figure (the median run) is above it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
runs=${1:-5}
target=${TARGET:-5}
cd "$root"
cargo bench -p kvgate-epp --bench decision --no-run >/dev/null 2>&1 \
  || cargo bench -p kvgate-epp --bench decision --no-run
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { # name case env...
  local name=$1 case=$2; shift 2
  for i in $(seq 1 "$runs"); do
    env KVGATE_BENCH_TRACE=ab "$@" cargo bench -q -p kvgate-epp --bench decision -- "$case" \
      2>/dev/null >"$out/$name.$i"
    grep -q "paired" "$out/$name.$i" || { echo "$name run $i printed no A/B figures" >&2; cat "$out/$name.$i" >&2; exit 2; }
  done
  echo "$name: $runs runs done" >&2
}
run default 8k KVGATE_BENCH_CALLER=none KVGATE_BENCH_TRACE_RATIO=0.1
run all 8k KVGATE_BENCH_CALLER=sampled
run spans spans KVGATE_BENCH_CALLER=sampled
python3 - "$out" "$runs" "$target" <<'PY'
import re, statistics, sys
out, runs, target = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
pat = re.compile(r"^(.*) paired: tracing adds (-?[\d.]+) µs .*\((-?[\d.]+)% of its p50 ([\d.]+) µs\) and (-?[\d.]+) µs")
rows = {}
for name in ["default", "all", "spans"]:
    for i in range(1, runs + 1):
        for line in open(f"{out}/{name}.{i}"):
            m = pat.match(line.strip())
            if m:
                rows.setdefault((name, m.group(1)), []).append(tuple(float(m.group(k)) for k in (2, 3, 4, 5)))
print(f"{'config':<8} {'case':<16} {'+CPU µs':>8} {'+% of p50':>10} {'untraced p50 µs':>16} {'+end µs':>8}   per run (+%)")
verdict, verdicts = 0, []
for (name, case), vals in rows.items():
    med = [statistics.median(v[k] for v in vals) for k in range(4)]
    per = " ".join(f"{v[1]:.1f}" for v in vals)
    print(f"{name:<8} {case:<16} {med[0]:>8.1f} {med[1]:>10.1f} {med[2]:>16.1f} {med[3]:>8.1f}   {per}")
    if name in ("default", "all") and case == "8k warm":
        met = med[1] <= target
        verdict |= 0 if met else 1
        verdicts.append(f"target ({name}): a warm 8k decision costs <= {target}% more with tracing on: "
                        f"{'met' if met else 'MISSED'} ({med[1]:.1f}%)")
print("\n".join(verdicts))
sys.exit(verdict)
PY
