#!/usr/bin/env bash
# Opt-in tier: coverage-guided fuzzing of the KV-event decoders (frames, payloads, envelopes).
#   scripts/fuzz.sh [seconds]     (default 60)
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly compiler flags: it uses a nightly
# toolchain when one is installed, else the pinned stable one with RUSTC_BOOTSTRAP=1.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root/fuzz"
secs=${1:-60}
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
# Seed the corpus with the captured engine payloads.
corpus="$root/fuzz/corpus/decode"
mkdir -p "$corpus"
shared=${KVGATE_SHARED:-$root/../shared}
if [ -d "$shared/fixtures" ] && [ -z "$(ls -A "$corpus")" ]; then
  python3 - "$shared/fixtures" "$corpus" <<'PY'
import base64, hashlib, json, pathlib, sys
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for f in src.rglob("frames*.jsonl"):
    for line in f.read_text().splitlines():
        payload = base64.b64decode(json.loads(line)["frames_b64"][2])
        (dst / hashlib.sha1(payload).hexdigest()).write_bytes(payload)
PY
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  cargo +nightly fuzz run decode "$corpus" -- -max_total_time="$secs"
else
  RUSTC_BOOTSTRAP=1 cargo fuzz run decode "$corpus" -- -max_total_time="$secs"
fi
