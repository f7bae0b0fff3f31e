#!/usr/bin/env bash
# Live vs virtual on a small case (issue #7: "check that live and virtual results agree within a
# stated tolerance"; docs/benchmarks.md § "Live vs discrete-event replay").
#
# The same shared-prefix workload (seeded; 8 groups × 8 users × 4 questions, 2,000-token system
# prompts, 50-token questions and answers, Poisson arrivals) at the same loads, on three engines
# of the same preset, routed by the same policies:
#   - live: `kvgate-bench compare` on one release stack (Envoy + EPP + sidecars + kvgate-sim at
#     --time-scale T; the load generator paces T× faster and records model time);
#   - virtual: `kvgate-bench replay` (engine model, scheduler and index in virtual time), with
#     --request-latency-ms standing for the live path's gateway and network time.
# Then prints, per policy and load, TTFT p50/p95, end-to-end p50 and the prefix hit rate (cached
# ÷ prompt tokens) of both, the virtual/live ratios, and whether each is within the tolerance.
#
#   e2e/bench/live_vs_replay.sh [loads] [policies]
# Environment: CARGO_TARGET_DIR; LVR_TIME_SCALE (default 2), LVR_PRESET (small),
# LVR_LATENCY_MS (the replay's request latency, default 10), LVR_TOLERANCE (0.25: ±25% on the
# latency figures, ±5 points on the hit rate), LVR_OUT (default a temporary directory).
# Exits 1 when a figure is outside the tolerance or a run is missing on one side.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
loads=${1:-4,8}
policies=${2:-kv,round-robin}
scale=${LVR_TIME_SCALE:-2}
preset=${LVR_PRESET:-small}
latency=${LVR_LATENCY_MS:-10}
tolerance=${LVR_TOLERANCE:-0.25}
target=${CARGO_TARGET_DIR:-$root/target}
for p in kvgate-e2e kvgate-sidecar kvgate-epp; do
  cargo build --release -p "$p" >/dev/null
done
bench="$target/release/kvgate-bench"
out=${LVR_OUT:-$(mktemp -d)}
mkdir -p "$out"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); preset $preset, time scale $scale, loads $loads, policies $policies"
"$bench" compare --engines 3 --preset "$preset" --time-scale "$scale" --log-level warn \
  --run-dir "$out/stack" --out "$out/live" --policies "$policies" --loads "$loads" \
  -- --workload shared-prefix --drain 60 --quiet >"$out/live.txt"
"$bench" replay --workload shared-prefix --engines 3 --preset "$preset" --policy "$policies" \
  --qps "$loads" --request-latency-ms "$latency" --out "$out/replay.jsonl" >"$out/replay.txt"
if python3 - "$out" "$tolerance" <<'EOF'
import glob, json, os, sys
out, tol = sys.argv[1], float(sys.argv[2])
def stats(recs):
    ok = [r for r in recs if r["status"] == "ok"]
    def pct(vals, p):
        vals = sorted(v for v in vals if v is not None)
        if not vals:
            return float("nan")
        k = max(0, min(len(vals) - 1, -(-int(p * len(vals) * 1000) // 1000) - 1))
        return vals[k]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return {
        "n": len(ok), "bad": len(recs) - len(ok),
        "ttft_p50": pct([r["ttft_ms"] for r in ok], 0.50),
        "ttft_p95": pct([r["ttft_ms"] for r in ok], 0.95),
        "e2e_p50": pct([r["e2e_ms"] for r in ok], 0.50),
        "hit": 100.0 * cached / prompt if prompt else float("nan"),
    }
live = {}
for path in glob.glob(os.path.join(out, "live", "*.jsonl")):
    recs = [json.loads(l) for l in open(path)]
    if recs:
        live[(recs[0]["run"], float(recs[0]["load"]))] = stats(recs)
virtual = {}
by = {}
for l in open(os.path.join(out, "replay.jsonl")):
    r = json.loads(l)
    by.setdefault((r["run"], float(r["load"])), []).append(r)
for k, recs in by.items():
    virtual[k] = stats(recs)
print(f"{'policy':<12} {'load':>5} {'figure':<9} {'live':>9} {'virtual':>9} {'ratio':>6}  verdict")
fails = 0
for key in sorted(set(live) & set(virtual)):
    l, v = live[key], virtual[key]
    for fig in ("ttft_p50", "ttft_p95", "e2e_p50", "hit"):
        a, b = l[fig], v[fig]
        if fig == "hit":
            ok = abs(a - b) <= 5.0
            ratio = f"{b - a:+.1f}pt"
        else:
            ok = a > 0 and abs(b / a - 1.0) <= tol
            ratio = f"{b / a:.2f}" if a > 0 else "n/a"
        fails += not ok
        print(f"{key[0]:<12} {key[1]:>5g} {fig:<9} {a:>9.1f} {b:>9.1f} {ratio:>6}  {'within' if ok else 'OUTSIDE'}")
    print(f"{key[0]:<12} {key[1]:>5g} requests  {l['n']:>9} {v['n']:>9}   (not ok: live {l['bad']}, virtual {v['bad']})")
missing = sorted(set(live) ^ set(virtual))
if missing:
    print(f"runs present on one side only: {missing}")
print(f"{fails} figure(s) outside the tolerance (±{tol:.0%} latency, ±5 points hit rate)")
if not (set(live) & set(virtual)):
    print("no run on both sides: nothing compared")
    sys.exit(1)
sys.exit(1 if fails or missing else 0)
EOF
then
  echo "records: $out/live/*.jsonl, $out/replay.jsonl"
else
  echo "live and virtual disagree (records: $out/live/*.jsonl, $out/replay.jsonl)" >&2
  exit 1
fi
