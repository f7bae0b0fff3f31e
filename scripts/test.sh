#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test of the workspace.
# Needs ../shared (beside the checkout) or KVGATE_SHARED for the captured KV-event fixtures.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
# The Dockerfiles: hadolint and their agreement with the workspace (seconds; building the images
# is the opt-in scripts/images.sh).
scripts/check-images.sh
# NIXL's C API (unpacked by bootstrap.sh) for the NIXL fabric's tests.
export KVGATE_TEST_NIXL_LIBRARY="$root/.cache/nixl/1.5.1/lib/libnixl_capi.so"
# The end-to-end tier (e2e/tests/stack.rs: the local stack with a real Envoy, NATS, sidecars and
# the EPP) is an ordinary integration test of kvgate-e2e; it runs below with the others, once.
# It starts kvgate-epp and kvgate-sidecar from the target directory, which --workspace builds.
if command -v cargo-nextest >/dev/null 2>&1; then
  # nextest does not run doctests; the crates document with ```text blocks only.
  cargo nextest run --workspace --all-targets --no-fail-fast
else
  cargo test --workspace --all-targets --no-fail-fast
fi
# The vLLM connector's pure modules and its client against the kvgate-kvbm just built (pytest in
# .venv; the tests that need torch and a real vLLM are the opt-in scripts/test-real-engine.sh).
echo "test: connectors/vllm (pytest)"
KVGATE_KVBM_BIN=${KVGATE_KVBM_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/kvgate-kvbm} \
  .venv/bin/python -m pytest -q -p no:cacheprovider connectors/vllm/tests --ignore=connectors/vllm/tests/engine
