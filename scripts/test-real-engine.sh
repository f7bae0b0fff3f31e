#!/usr/bin/env bash
# Opt-in tier: the real-engine checks (sidecar/tests/real_vllm.rs) against a real vLLM 0.32 on CPU
# with a tiny random-weight Qwen3 and the real Qwen3 tokenizer:
#   a. vLLM's ZMQ KV events → kvgate-sidecar → nats-server carry the router's keys, one epoch,
#      contiguous seq; snapshots; a restarted sidecar starts a new epoch;
#   b. Envoy → kvgate-epp (NATS, real tokenizer) routes a cached prefix to the engine holding it,
#      confirmed by the engine's own usage.prompt_tokens_details.cached_tokens;
#   c. the sidecar's pass-through proxy streams vLLM's SSE unchanged;
#   d. kvgate's vLLM KV connector (connectors/vllm) in that vLLM with a real kvgate-kvbm: a prefix
#      evicted from vLLM's cache is loaded back from the daemon (cached tokens, the same
#      log-probabilities), a daemon restart loses no request, and the worker's block copies.
#
#   scripts/test-real-engine.sh [cargo options, e.g. --release]
#       (idempotent; the first run installs ~8.3 GB in about 5 min)
#
# Runs the shared setup (../shared/scripts/real-vllm/setup.sh, which skips finished steps), builds
# the binaries, then runs the ignored test with KVGATE_REAL_VLLM=1 (CI's ordinary run skips it as
# ignored). Needs ~5 GiB of free memory while vLLM runs.
# Environment: KVGATE_SHARED (default ../shared), KVGATE_REAL_VLLM_DIR (default
# ~/.cache/kvgate-real-vllm), CARGO_TARGET_DIR; KVGATE_EPP_BIN and KVGATE_SIM_BIN use those
# binaries instead of building them.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
shared=${KVGATE_SHARED:-$root/../shared}
die() { echo "test-real-engine: $*" >&2; exit 2; }
setup="$shared/scripts/real-vllm/setup.sh"
[ -f "$setup" ] ||
  die "$setup not found: the real-vLLM scripts live in the shared checkout beside this repository (../shared); set KVGATE_SHARED to its path"
shared=$(cd "$shared" && pwd)
dir=${KVGATE_REAL_VLLM_DIR:-$HOME/.cache/kvgate-real-vllm}
# setup.sh refuses to install with less than 12 GB free on the directory's filesystem and says so.
bash "$setup" "$dir" || die "the real-vLLM setup failed (see above): it needs ~12 GB of free disk, Python 3.10-3.13 and npm"
avail_gib=$(awk '/^MemAvailable:/ { print int($2 / 1048576) }' /proc/meminfo)
[ "$avail_gib" -ge 5 ] || die "only ${avail_gib} GiB of memory available; one vLLM server needs about 4.5 GiB"
[ -x "${KVGATE_NATS_SERVER:-/usr/sbin/nats-server}" ] || die "nats-server not found (Debian: apt-get install nats-server, or set KVGATE_NATS_SERVER)"
cd "$root"
[ -n "${KVGATE_EPP_BIN:-}" ] || cargo build "$@" -p kvgate-epp --bin kvgate-epp
[ -n "${KVGATE_SIM_BIN:-}" ] || cargo build "$@" -p kvgate-e2e --bin kvgate-sim
[ -n "${KVGATE_KVBM_BIN:-}" ] || cargo build "$@" -p kvgate-kvbm --bin kvgate-kvbm
KVGATE_REAL_VLLM=1 KVGATE_REAL_VLLM_DIR="$dir" KVGATE_SHARED="$shared" \
  cargo test "$@" -p kvgate-sidecar --test real_vllm -- --ignored --nocapture
# d. The connector's tests run in vLLM's own environment (torch, vLLM); they add pytest and the
# connector's one dependency vLLM lacks (xxhash) to it.
"$dir/venv/bin/pip" install -q --disable-pip-version-check pytest==9.0.1 xxhash==3.6.0
profile=debug
case " $* " in *" --release "*) profile=release ;; esac
KVGATE_KVBM_BIN=${KVGATE_KVBM_BIN:-${CARGO_TARGET_DIR:-$root/target}/$profile/kvgate-kvbm} \
  KVGATE_SHARED="$shared" KVGATE_REAL_VLLM_DIR="$dir" \
  "$dir/venv/bin/python" -m pytest -q -p no:cacheprovider connectors/vllm/tests/engine
