#!/usr/bin/env bash
# The main job. It runs, on embedded defaults:
#   1. the local stack's demos: `kvgate-bench up` (NATS, three kvgate-sim engines behind
#      kvgate-sidecars, kvgate-epp, a real Envoy), a shared-prefix conversation through Envoy that
#      sticks to the engine holding its prefix with cached tokens, then Ctrl-C (e2e/stack_demo.sh);
#      and `kvgate-bench up --kube`: the Helm chart installed into a local Kubernetes API server,
#      its rendered containers run here, a conversation that sticks to its pod until kubectl
#      turns that pod NotReady (e2e/kube_demo.sh);
#   2. the routing benchmark, live: `kvgate-bench compare` on one stack of three engines, a
#      shared-prefix workload at two rates for kv, round-robin, least-load and prefix-only, then
#      the peer routers vllm-router and smg (PyPI, installed into .routers-venv) on the same
#      engines; the live stack's request rate through Envoy + EPP (e2e/bench/stack_rate.sh); and
#      live vs discrete-event results on a small case (e2e/bench/live_vs_replay.sh);
#   3. the routing benchmark in virtual time: `kvgate-bench replay` of seed 001's workload on
#      three H200 engines for every policy at concurrency 60-180 (the seed's round-robin columns
#      are its fidelity check, docs/benchmarks.md), then the Mooncake hour on 16 engines at the
#      load where round-robin's p90 TTFT is 2 s, against the peer routers' cache-aware policy
#      (a model, `sglang-cache-aware`), the same hour with 128 GiB of KV offloaded to host
#      memory per engine at round-robin's 2 s crossing there, and the trace's first 10 minutes
#      with prefix-only; tables on stdout, plots under $KVGATE_MAIN_OUT (default /tmp/kvgate-main);
#   4. the simulator's throughput benchmark (e2e/bench/sim_throughput.sh, needs wrk);
#   5. Envoy direct vs Envoy+EPP latency and EPP CPU per request (e2e/bench/envoy_overhead.sh);
#   6. the EPP decision cost at 8k tokens (cargo bench -p kvgate-epp --bench decision -- 8k);
#   7. the KV-event and prefix-index benchmarks in release.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
echo "== local stack demo (kvgate-bench up)"
e2e/stack_demo.sh --release
echo "== Kubernetes demo (kvgate-bench up --kube: the Helm chart on a local API server)"
e2e/kube_demo.sh --release
bench="${CARGO_TARGET_DIR:-$root/target}/release/kvgate-bench"
out=${KVGATE_MAIN_OUT:-/tmp/kvgate-main}
# The shared inputs beside the checkout (or $KVGATE_SHARED, as for the tests).
trace="${KVGATE_SHARED:-$root/../shared}/traces/mooncake_conversation_trace.jsonl"
rm -rf "$out"; mkdir -p "$out"
routers_venv=${KVGATE_ROUTERS_VENV:-$root/.routers-venv}
if [ ! -x "$routers_venv/bin/smg" ] || [ ! -x "$routers_venv/bin/vllm-router" ]; then
  echo "main: installing the peer routers (vllm-router, smg) into $routers_venv"
  python3 -m venv "$routers_venv"
  "$routers_venv/bin/pip" install -q vllm-router==0.1.17 smg==1.13.0
fi
export KVGATE_ROUTERS_VENV=$routers_venv
echo "== live routing comparison (kvgate-bench compare; records and plots in $out/compare)"
"$bench" compare --engines 3 --time-scale 2 --log-level warn --run-dir "$out/stack" \
  --out "$out/compare" --policies kv,round-robin,least-load,prefix-only \
  --routers vllm-router,smg --loads 4,8 \
  -- --workload shared-prefix --duration 20 --groups 4 --users-per-group 8 --text-prompts
echo "== live stack request rate through Envoy + EPP (short prompts)"
e2e/bench/stack_rate.sh 15 64
echo "== live vs discrete-event replay on a small case"
LVR_OUT="$out/live-vs-replay" e2e/bench/live_vs_replay.sh
echo "== discrete-event replay: seed 001's workload, every policy (plots in $out/replay-doks)"
"$bench" replay --workload doks --engines 3 --preset h200-llama70b-fp8 \
  --policy round-robin,kv,prefix-only,least-load,random --concurrency 60,80,100,120,140,160,180 \
  --request-latency-ms 200 --think-ms 3000 --out "$out/replay-doks.jsonl"
"$bench" report --in "$out/replay-doks.jsonl" --out "$out/replay-doks" --warmup 60 > /dev/null
echo "== discrete-event replay: the Mooncake hour on 16 engines at 3.15x (round-robin's p90 ~2 s)"
"$bench" replay --workload mooncake --trace "$trace" --engines 16 --preset small \
  --policy round-robin,kv,sglang-cache-aware --speedup 3.15 --out "$out/replay-mooncake-hour.jsonl"
echo "== discrete-event replay: the Mooncake hour, 128 GiB of KV offloading per engine, at 3.25x (round-robin's p90 ~2 s)"
"$bench" replay --workload mooncake --trace "$trace" --engines 16 --preset small --kv-offloading-gib 128 \
  --policy round-robin,kv --speedup 3.25 --out "$out/replay-mooncake-offload.jsonl"
echo "== discrete-event replay: the Mooncake trace's first 10 minutes on 16 engines at 2.5x"
"$bench" replay --workload mooncake --trace "$trace" --engines 16 --preset small --policy round-robin,kv,prefix-only \
  --speedup 2.5 --trace-seconds 600 --out "$out/replay-mooncake.jsonl"
echo "== autoscaling in virtual time: the planner against static peak, an HPA and an oracle (plots in $out/autoscale)"
"$bench" autoscale --trace "$trace" --out "$out/autoscale"
"$bench" autoscale --trace "$trace" --out "$out/autoscale-budget" --budget 18 \
  --scalers planner,independent,oracle --profile "$out/autoscale/profile.yaml"
echo "== a replica's profile as the ConfigMap a PoolAutoscaler reads ($out/profile-cm.yaml)"
"$bench" profile --trace "$trace" --name llama-profile --out "$out/profile-cm.yaml"
if ! command -v wrk >/dev/null 2>&1; then
  echo "main: installing wrk for the simulator benchmark"
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y -qq wrk >/dev/null; else sudo apt-get install -y -qq wrk >/dev/null; fi
fi
echo "== kvgate-sim throughput"
e2e/bench/sim_throughput.sh 10
echo "== Envoy+EPP overhead over Envoy direct, and EPP CPU per request"
e2e/bench/envoy_overhead.sh 8
echo "== EPP decision cost (8k-token chats)"
cargo bench -p kvgate-epp --bench decision -- 8k
echo "== KV-event and prefix-index benchmarks"
cargo bench -p kvgate-kv-events -p kvgate-kv-index
