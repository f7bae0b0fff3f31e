#!/usr/bin/env bash
# Builds kvgate's container images without a Docker daemon, then checks each one.
#
#   scripts/images.sh [--only epp,sidecar,kvbm,sim,kvbm-nixl] [--out DIR] [--skip-build | --check-only]
#
# For each image: the distroless/cc-style Debian bookworm root made by images/rootfs.sh
# (mmdebstrap, from Debian's packages; one root, the first layer of the first four) and the
# release binary (cargo build --release --locked), two layers (GNU tar) added to an OCI image
# layout with umoci, configured as images/Dockerfile configures its targets (user 65532:65532,
# entrypoint, the Dockerfile's labels). kvgate-kvbm-nixl is the block manager's binary on a
# root with libssl3 and zlib1g added, and a third layer: NIXL and UCX under /opt/nixl
# (images/nixl-layer.sh, from the PyPI wheel nixl-cu12), on the image's LD_LIBRARY_PATH.
# Each image is written as
#   DIR/<name>/                  an OCI layout, tag <version>  (skopeo copy oci:DIR/<name>:<version> docker://…)
#   DIR/<name>-<version>.tar     a docker-archive tagged <registry>/<name>:<version>  (docker load -i, kind load image-archive)
# <registry> is ghcr.io/kvgate (KVGATE_IMAGE_REGISTRY), <version> the workspace's (Cargo.toml).
# DIR defaults to $CARGO_TARGET_DIR/images, or target/images without it.
#
# The check unpacks each image (umoci unpack) and verifies its config (user, entrypoint,
# labels), its files (no setuid/setgid file, no file capability, no shell, nothing writable
# by others but /tmp, the CA bundle), and runs `<binary> --help` from the image's root the way
# a kvgate pod runs it: as 65532:65532, no capabilities, no_new_privs, read-only root, the
# image's environment, every symbol bound at load (LD_BIND_NOW). Two images also serve for
# real that way: the block manager (remote tier over TLS, so its CA roots must load; disk and
# socket on a mounted tmpfs; a real nats-server; ready, then SIGTERM, exit 0), the same with
# NIXL (kvgate-kvbm-nixl: --peer-fabric nixl, so NIXL's C API, its UCX backend and UCX load
# from /opt/nixl with every symbol bound), and the simulator (KV events over ZMQ; healthy, a
# completion answered, then SIGTERM, exit 0).
#
# Needs root for all but the cargo build (mmdebstrap, umoci, mount namespaces): run as another
# user, it builds the binaries, then says how to go on under sudo. Installs what it needs from
# Debian (mmdebstrap umoci skopeo jq binutils libcap2-bin curl nats-server python3-pip),
# idempotently; kvgate-kvbm-nixl downloads the nixl-cu12 wheel from PyPI.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
self="$root/scripts/images.sh"
cd "$root"
started=$SECONDS
say() { printf 'images: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$self"
  cat <<'EOF'
Options:
  --only LIST    images to build, comma-separated: epp, sidecar, kvbm, sim, kvbm-nixl
                 (default: all five)
  --out DIR      output directory (default: $CARGO_TARGET_DIR/images or target/images)
  --skip-build   use the release binaries already built instead of running cargo
  --check-only   build nothing: check the OCI layouts DIR/<name> (tag <version>) already
                 there, e.g. images built by Docker and copied out with
                 skopeo copy docker-daemon:<image> oci:DIR/<name>:<version>
  -h, --help     this text
EOF
}

all=(epp sidecar kvbm sim kvbm-nixl)
only=
out=
skip_build=0
check_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --only) [ $# -ge 2 ] || die "--only needs a list"; only=$2; shift 2 ;;
    --only=*) only=${1#*=}; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --skip-build) skip_build=1; shift ;;
    --check-only) check_only=1; skip_build=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

selected=()
if [ -z "$only" ]; then
  selected=("${all[@]}")
else
  IFS=, read -r -a wanted <<<"$only"
  for w in "${wanted[@]}"; do
    w=${w#kvgate-}
    case " ${all[*]} " in *" $w "*) ;; *) die "unknown image '$w' (known: ${all[*]})" ;; esac
    case " ${selected[*]} " in *" $w "*) ;; *) selected+=("$w") ;; esac
  done
  [ ${#selected[@]} -gt 0 ] || die "--only names no image"
fi

# The cargo package and the binary of each image.
declare -A package=([epp]=kvgate-epp [sidecar]=kvgate-sidecar [kvbm]=kvgate-kvbm [sim]=kvgate-e2e
  [kvbm-nixl]=kvgate-kvbm)
declare -A binary=([epp]=kvgate-epp [sidecar]=kvgate-sidecar [kvbm]=kvgate-kvbm [sim]=kvgate-sim
  [kvbm-nixl]=kvgate-kvbm)

version=$(awk '/^\[workspace\.package\]/ { s = 1; next } /^\[/ { s = 0 }
  s && $1 == "version" { gsub(/"/, "", $3); print $3; exit }' Cargo.toml)
[ -n "$version" ] || die "no version in Cargo.toml's [workspace.package]"
registry=${KVGATE_IMAGE_REGISTRY:-ghcr.io/kvgate}
target_dir=${CARGO_TARGET_DIR:-$root/target}
out=${out:-$target_dir/images}
dockerfile="$root/images/Dockerfile"

# --- Release binaries (as the invoking user) ----------------------------------------------
if [ "$skip_build" -eq 0 ]; then
  command -v cargo >/dev/null || die "cargo is missing"
  build=()
  for c in "${selected[@]}"; do
    case " ${build[*]} " in *" ${binary[$c]} "*) ;; *) build+=(-p "${package[$c]}" --bin "${binary[$c]}") ;; esac
  done
  say "cargo build --release --locked ${build[*]}"
  build_started=$SECONDS
  cargo build --release --locked "${build[@]}"
  say "release binaries built in $((SECONDS - build_started)) s"
fi
for c in "${selected[@]}"; do
  if [ "$check_only" -eq 1 ]; then
    [ -f "$out/kvgate-$c/index.json" ] || die "no OCI layout $out/kvgate-$c to check"
  else
    [ -x "$target_dir/release/${binary[$c]}" ] ||
      die "$target_dir/release/${binary[$c]} is missing (run without --skip-build)"
  fi
done

# Everything below needs root.
if [ "$(id -u)" -ne 0 ]; then
  die "the rest needs root (mmdebstrap, umoci, mount namespaces): sudo --preserve-env=CARGO_TARGET_DIR $self $([ "$check_only" -eq 1 ] && echo --check-only || echo --skip-build) --only $(IFS=,; echo "${selected[*]}") --out $out"
fi

# --- Tools (Debian packages) --------------------------------------------------------------
declare -A tool_package=([mmdebstrap]=mmdebstrap [umoci]=umoci [skopeo]=skopeo [jq]=jq
  [objcopy]=binutils [getcap]=libcap2-bin [curl]=curl [unshare]=util-linux
  [setpriv]=util-linux)
case " ${selected[*]} " in *" kvbm "* | *" kvbm-nixl "*) tool_package[nats-server]=nats-server ;; esac
case " ${selected[*]} " in *" kvbm-nixl "*) tool_package[readelf]=binutils; tool_package[pip3]=python3-pip ;; esac
missing=()
for tool in "${!tool_package[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("${tool_package[$tool]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  say "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
PATH=$PATH:/usr/sbin:/sbin

revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  say "the working tree has uncommitted changes: the label revision=$revision does not name all of it"
fi
created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
arch=$(dpkg --print-architecture)

mkdir -p "$out"
work=$(mktemp -d "$out/.work.XXXXXX")
# umoci unpack leaves read-only directories in test roots; chmod before removing.
# shellcheck disable=SC2317 # called by the trap
cleanup() { chmod -R u+w "$work" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# The labels of a Dockerfile stage and of the stage it is built on (runtime-labels), with
# the build arguments substituted: the images made here carry what `docker build` would put.
# shellcheck disable=SC2016 # the Dockerfile's literal ${...}
labels_of() {
  local stage=$1 line key value
  awk -v want="$stage" '/^FROM / { stage = $NF } stage == "runtime-labels" || stage == want' "$dockerfile" |
    grep -o 'org\.opencontainers\.image\.[a-z.]*="[^"]*"' |
    while IFS= read -r line; do
      key=${line%%=*}
      value=${line#*=\"}
      value=${value%\"}
      value=${value//'${VERSION}'/$version}
      value=${value//'${REVISION}'/$revision}
      value=${value//'${CREATED}'/$created}
      printf '%s=%s\n' "$key" "$value"
    done
}

# --- Runtime root -------------------------------------------------------------------------
rootfs="$work/rootfs"

# A layer: the directory's entries as an uncompressed tar, sorted, numeric owners, without
# atime and ctime. (umoci insert would make the layers itself, but umoci 0.4.7's end them
# short of the tar trailer: Go's reader accepts that, GNU tar and Python's tarfile do not.)
layer_tar() {
  local dir=$1 file=$2 entries
  mapfile -t entries < <(cd "$dir" && LC_ALL=C ls -A)
  tar --create --file "$file" --directory "$dir" --sort=name --numeric-owner --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime "${entries[@]}"
}

if [ "$check_only" -eq 0 ]; then
  "$root/images/rootfs.sh" "$rootfs"
  layer_tar "$rootfs" "$work/rootfs.tar" # one blob, the same in every image but the NIXL one
  case " ${selected[*]} " in
    *" kvbm-nixl "*)
      # NIXL's C API links libssl and zlib; the other images need neither.
      "$root/images/rootfs.sh" "$work/rootfs-nixl" libssl3 zlib1g
      layer_tar "$work/rootfs-nixl" "$work/rootfs-nixl.tar"
      "$root/images/nixl-layer.sh" "$work/nixl"
      chown -R 0:0 "$work/nixl"
      layer_tar "$work/nixl" "$work/nixl.tar"
      ;;
  esac
fi

# --- Images -------------------------------------------------------------------------------
build_image() {
  local c=$1 name="kvgate-$1" layout="$out/kvgate-$1" stage="$work/bin-$1" label
  local bin=${binary[$1]} config=(--config.env PATH=/usr/local/bin:/usr/bin:/bin)
  rm -rf "$layout" "$out/$name-$version.tar"
  # The binary without its debug info (its symbols kept), as the Dockerfile's build stages.
  install -d -m 0755 "$stage/usr/local/bin"
  objcopy --strip-debug "$target_dir/release/$bin" "$stage/usr/local/bin/$bin"
  chown -R 0:0 "$stage"
  chmod 0755 "$stage/usr/local/bin/$bin"
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  layer_tar "$stage" "$work/bin-$c.tar"
  if [ "$c" = kvbm-nixl ]; then
    umoci raw add-layer --image "$layout:$version" \
      --history.created_by "images/rootfs.sh (libssl3 zlib1g)" "$work/rootfs-nixl.tar"
  else
    umoci raw add-layer --image "$layout:$version" --history.created_by "images/rootfs.sh" \
      "$work/rootfs.tar"
  fi
  umoci raw add-layer --image "$layout:$version" --history.created_by "$bin release binary" \
    "$work/bin-$c.tar"
  if [ "$c" = kvbm-nixl ]; then
    umoci raw add-layer --image "$layout:$version" --history.created_by "images/nixl-layer.sh" \
      "$work/nixl.tar"
    config+=(--config.env LD_LIBRARY_PATH=/opt/nixl/lib)
  fi
  local labels=()
  while IFS= read -r label; do labels+=(--config.label "$label"); done < <(labels_of "$name")
  [ ${#labels[@]} -ge 16 ] || die "images/Dockerfile: too few labels for stage $name"
  config+=("${labels[@]}")
  umoci config --image "$layout:$version" --os linux --architecture "$arch" \
    --created "$created" --author kvgate --history.created_by "scripts/images.sh config" \
    --config.user 65532:65532 --config.entrypoint "/usr/local/bin/$bin" \
    --config.workingdir / "${config[@]}"
  umoci gc --layout "$layout"
  skopeo copy --quiet "oci:$layout:$version" \
    "docker-archive:$out/$name-$version.tar:$registry/$name:$version"
}

# The digest of the image's manifest, its config and its size (bytes of the compressed
# layers and config, what a pull downloads).
manifest_digest() {
  jq -r --arg v "$version" \
    '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $v) | .digest' \
    "$1/index.json"
}
blob() { local d=$2; printf '%s/blobs/%s/%s' "$1" "${d%%:*}" "${d#*:}"; }

# Runs a command from an unpacked image's root as a kvgate pod does: uid/gid 65532, no
# supplementary group, no capability, no_new_privs, the root read-only, what a container
# runtime mounts (/proc; /sys read-only; a /dev tmpfs with null, zero, random, urandom and a
# 64 MiB /dev/shm), a fresh PID namespace (the command is PID 1), the environment given and
# nothing else. With
# SANDBOX_TMPFS=1 a tmpfs owned by 65532 is mounted on /tmp, as a pod's volume would be, and
# SANDBOX_SECRET, a file, is copied into it as /tmp/peer-secret (as a mounted Secret would be).
sandbox() {
  local r=$1
  shift
  mkdir -p "$r/proc" "$r/sys" "$r/dev" # the mount points, as the runtime creates them
  # shellcheck disable=SC2016 # the inner script's variables are its own
  env -i "${sandbox_env[@]}" SANDBOX_TMPFS="${SANDBOX_TMPFS:-0}" SANDBOX_SECRET="${SANDBOX_SECRET:-}" \
    unshare --mount --pid --fork --kill-child --propagation private -- sh -euc '
      r=$1; shift
      mount --bind "$r" "$r"
      mount -t proc proc "$r/proc"
      mount --rbind /sys "$r/sys"
      mount -o remount,bind,ro "$r/sys"
      mount -t tmpfs -o mode=0755,size=64k tmpfs "$r/dev"
      for n in null zero random urandom; do
        touch "$r/dev/$n"
        mount --bind "/dev/$n" "$r/dev/$n"
      done
      mkdir "$r/dev/shm"
      mount -t tmpfs -o mode=1777,size=64m tmpfs "$r/dev/shm"
      if [ "$SANDBOX_TMPFS" = 1 ]; then
        mount -t tmpfs -o uid=65532,gid=65532,mode=0700,size=64m tmpfs "$r/tmp"
        if [ -n "$SANDBOX_SECRET" ]; then
          install -o 65532 -g 65532 -m 0400 "$SANDBOX_SECRET" "$r/tmp/peer-secret"
        fi
      fi
      unset SANDBOX_TMPFS SANDBOX_SECRET
      mount -o remount,bind,ro "$r"
      exec setpriv --no-new-privs unshare --root="$r" --wd=/ --setgid=65532 --setuid=65532 -- "$@"
    ' sandbox "$r" "$@"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Starts a server from an unpacked image's root in the sandbox (a tmpfs on /tmp) and waits
# until URL answers 200. Sets server_pid (the sandbox's subshell) and server (the server
# itself: PID 1 of its namespace, the end of the chain subshell → unshare → server, the rest
# exec'd; the process a kubelet would signal).
server_start() {
  local r=$1 log=$2 url=$3 _ next
  shift 3
  SANDBOX_TMPFS=1 sandbox "$r" "$@" >"$log" 2>&1 &
  server_pid=$!
  server=
  for _ in $(seq 1 300); do
    if curl -fsS "$url" >/dev/null 2>&1; then
      server=$server_pid
      while next=$(pgrep -P "$server" | head -n 1) && [ -n "$next" ]; do server=$next; done
      return 0
    fi
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "images: $url never answered 200" >>"$log"
  server_kill
  return 1
}
server_kill() {
  local next
  if [ -z "$server" ]; then
    server=$server_pid
    while next=$(pgrep -P "$server" | head -n 1) && [ -n "$next" ]; do server=$next; done
  fi
  kill -KILL "$server" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
}
# SIGTERM to the server; it must exit 0 within 10 s.
server_stop() {
  local log=$1 _ rc=0
  kill -TERM "$server"
  for _ in $(seq 1 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$server_pid" 2>/dev/null; then
    echo "images: still running 10 s after SIGTERM" >>"$log"
    server_kill
    return 1
  fi
  wait "$server_pid" || rc=$?
  [ "$rc" -eq 0 ] || { echo "images: exit status $rc after SIGTERM" >>"$log"; return 1; }
}

# The block manager from an image, as 65532 on the read-only root with a real nats-server:
# its socket on the tmpfs, the flags given, until ready (NATS connected), then SIGTERM, exit 0.
kvbm_serve() {
  local r=$1 log=$2 nats_port metrics_port nats_pid rc=0
  shift 2
  nats_port=$(free_port)
  metrics_port=$(free_port)
  nats-server -a 127.0.0.1 -p "$nats_port" >"$log.nats" 2>&1 &
  nats_pid=$!
  if server_start "$r" "$log" "http://127.0.0.1:$metrics_port/readyz" /usr/local/bin/kvgate-kvbm \
    --socket /tmp/run/kvbm.sock --host-bytes 16777216 \
    --nats-url "nats://127.0.0.1:$nats_port" --metrics-bind 127.0.0.1 \
    --metrics-port "$metrics_port" --namespace images --node check --model check "$@"; then
    server_stop "$log" || rc=1
  else
    rc=1
  fi
  kill "$nats_pid" 2>/dev/null || true
  wait "$nats_pid" 2>/dev/null || true
  return "$rc"
}

# The block manager's tiers: the disk tier on the tmpfs, a remote tier over TLS (the system's
# CA roots must load before it connects; nothing listens there, so the tier is unreachable,
# not broken).
kvbm_smoke() {
  local r=$1 log=$2
  kvbm_serve "$r" "$log" --disk-dir /tmp/disk --disk-bytes 16777216 \
    --remote-url "rediss://127.0.0.1:$(free_port)" || return 1
  grep -q 'remote store unreachable' "$log" || { echo "images: the remote tier's TLS set-up did not run" >>"$log"; return 1; }
  grep -q 'disk tier ready' "$log" || { echo "images: the disk tier did not open" >>"$log"; return 1; }
}

# The block manager from the NIXL image with --peer-fabric nixl: NIXL's C API (found on the
# image's LD_LIBRARY_PATH), an agent and its UCX backend must load from /opt/nixl with every
# symbol bound before the daemon gets ready.
nixl_smoke() {
  local r=$1 log=$2
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/peer-secret"
  SANDBOX_SECRET="$work/peer-secret" kvbm_serve "$r" "$log" \
    --peer-listen "127.0.0.1:$(free_port)" --peer-secret-file /tmp/peer-secret \
    --peer-fabric nixl --nixl-buffers 1 || return 1
  grep -q 'pull answers travel through NIXL' "$log" || { echo "images: NIXL did not load" >>"$log"; return 1; }
}

# The simulator from its image, publishing KV events over ZMQ (libzmq, C++): healthy, a
# completion answered, then SIGTERM, exit 0.
sim_smoke() {
  local r=$1 log=$2 port rc=0 reply
  port=$(free_port)
  server_start "$r" "$log" "http://127.0.0.1:$port/health" /usr/local/bin/kvgate-sim \
    --host 127.0.0.1 --port "$port" --model check --kv-events-config \
    "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$(free_port)\",\"replay_endpoint\":\"tcp://127.0.0.1:$(free_port)\"}" ||
    return 1
  reply=$(curl -fsS "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"check","prompt":"hello from the image check","max_tokens":4}' 2>&1) || rc=1
  server_stop "$log" || rc=1
  grep -q '"completion_tokens":4' <<<"$reply" || { echo "images: completion: $reply" >>"$log"; rc=1; }
  grep -q 'publishing KV events' "$log" || { echo "images: no KV-event publisher" >>"$log"; rc=1; }
  return "$rc"
}

# Every check of one image; prints what fails and returns non-zero if anything did.
check_image() {
  local c=$1 name="kvgate-$1" layout="$out/kvgate-$1" bundle="$work/check-$1" cfg fails=0 f
  local bin=${binary[$1]} help_out="$work/help-$1.txt"
  fail() { say "$name: FAIL: $*"; fails=$((fails + 1)); }
  umoci unpack --image "$layout:$version" "$bundle" >/dev/null
  local r="$bundle/rootfs"
  unpacked[$c]=$(du -sb --apparent-size "$r" | cut -f1)
  cfg=$(blob "$layout" "$(jq -r .config.digest "$(blob "$layout" "$(manifest_digest "$layout")")")")
  [ "$(jq -r .config.User "$cfg")" = 65532:65532 ] || fail "config User is $(jq -r .config.User "$cfg")"
  [ "$(jq -c .config.Entrypoint "$cfg")" = "[\"/usr/local/bin/$bin\"]" ] ||
    fail "config Entrypoint is $(jq -c .config.Entrypoint "$cfg")"
  [ "$(jq -c .config.Cmd "$cfg")" = null ] || fail "config Cmd is $(jq -c .config.Cmd "$cfg")"
  [ "$(jq -r '.config.Labels["org.opencontainers.image.title"]' "$cfg")" = "$name" ] || fail "label title"
  [ "$(jq -r '.config.Labels["org.opencontainers.image.version"]' "$cfg")" = "$version" ] || fail "label version"
  f=$(jq -r '.config.Labels["org.opencontainers.image.revision"] // ""' "$cfg")
  if [ "$check_only" -eq 1 ]; then
    case $f in "" | unknown) fail "label revision is '$f' (docker build --build-arg REVISION=…)" ;; esac
  else
    [ "$f" = "$revision" ] || fail "label revision is '$f', not $revision"
  fi
  [ "$(jq -r '.os + "/" + .architecture' "$cfg")" = "linux/$arch" ] || fail "platform"

  # Every layer a complete archive: GNU tar reads it to its end-of-archive trailer.
  while IFS=' ' read -r f d; do
    case $f in
      *tar+gzip) gzip -dc "$(blob "$layout" "$d")" | tar -t >/dev/null 2>&1 || fail "layer $d is not a complete tar" ;;
      *tar) tar -tf "$(blob "$layout" "$d")" >/dev/null 2>&1 || fail "layer $d is not a complete tar" ;;
      *) fail "layer $d: media type $f not checked" ;;
    esac
  done < <(jq -r '.layers[] | .mediaType + " " + .digest' "$(blob "$layout" "$(manifest_digest "$layout")")")
  f=$(find "$r" -xdev -perm /6000 -printf '/%P ')
  [ -z "$f" ] || fail "setuid/setgid files: $f"
  f=$(getcap -r "$r" 2>/dev/null)
  [ -z "$f" ] || fail "files with capabilities: $f"
  f=$(find "$r" -xdev -perm -0002 ! -type l ! -path "$r/tmp" -printf '/%P ')
  [ -z "$f" ] || fail "writable by others: $f"
  f=$(find "$r" -xdev ! -type l \( ! -user 0 -o ! -group 0 \) ! -path "$r/home/nonroot" -printf '/%P ')
  [ -z "$f" ] || fail "not owned by root: $f"
  for f in bin/sh usr/bin/sh bin/bash usr/bin/bash bin/busybox usr/bin/busybox usr/bin/apt usr/bin/dpkg; do
    [ ! -e "$r/$f" ] || fail "/$f is in the image"
  done
  [ "$(stat -c %a:%u:%g "$r/usr/local/bin/$bin")" = 755:0:0 ] || fail "the binary is not 0755 root:root"
  f=$(grep -c 'BEGIN CERTIFICATE' "$r/etc/ssl/certs/ca-certificates.crt" 2>/dev/null || true)
  [ "${f:-0}" -ge 100 ] || fail "no CA bundle at /etc/ssl/certs/ca-certificates.crt (${f:-0} certificates)"
  grep -qx 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' "$r/etc/passwd" || fail "no nonroot in /etc/passwd"

  mapfile -t sandbox_env < <(jq -r '.config.Env[]' "$cfg")
  sandbox_env+=(LD_BIND_NOW=1)
  local rc=0
  sandbox "$r" "/usr/local/bin/$bin" --help >"$help_out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "$bin --help exited $rc: $(head -c 600 "$help_out")"
  elif ! grep -q "^Usage: $bin " "$help_out"; then
    fail "$bin --help printed no 'Usage: $bin' line: $(head -c 600 "$help_out")"
  fi
  case $c in
    kvbm) kvbm_smoke "$r" "$work/smoke-$c.log" || fail "serving from the image: $(tail -n 20 "$work/smoke-$c.log")" ;;
    kvbm-nixl)
      kvbm_smoke "$r" "$work/smoke-$c.log" || fail "serving from the image: $(tail -n 20 "$work/smoke-$c.log")"
      nixl_smoke "$r" "$work/smoke-nixl.log" || fail "NIXL from the image: $(tail -n 20 "$work/smoke-nixl.log")"
      [ -f "$r/opt/nixl/LICENSES/LICENSE" ] || fail "no NIXL licence in /opt/nixl/LICENSES"
      ;;
    sim) sim_smoke "$r" "$work/smoke-$c.log" || fail "serving from the image: $(tail -n 20 "$work/smoke-$c.log")" ;;
  esac
  chmod -R u+w "$bundle"
  rm -rf "$bundle"
  [ "$fails" -eq 0 ]
}

declare -A result=() size=() unpacked=() digest=()
status=0
for c in "${selected[@]}"; do
  name="kvgate-$c"
  if [ "$check_only" -eq 0 ]; then
    say "building $registry/$name:$version"
    build_image "$c"
  fi
  m=$(manifest_digest "$out/$name")
  digest[$c]=$m
  size[$c]=$(jq '([.layers[].size] | add) + .config.size' "$(blob "$out/$name" "$m")")
  say "checking $name"
  if check_image "$c"; then result[$c]=ok; else result[$c]=FAILED; status=1; fi
done

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
printf '\n%-40s %12s %12s  %-19s %s\n' image compressed unpacked digest check
for c in "${selected[@]}"; do
  printf '%-40s %12s %12s  %-19s %s\n' "$registry/kvgate-$c:$version" \
    "$(mib "${size[$c]}")" "$(mib "${unpacked[$c]}")" "${digest[$c]:0:19}" "${result[$c]}"
done
if [ "$check_only" -eq 1 ]; then
  printf '\nchecked the OCI layouts in %s; %d s in all\n' "$out" "$((SECONDS - started))"
else
  printf '\nOCI layouts and docker archives in %s; %d s in all\n' "$out" "$((SECONDS - started))"
fi
exit "$status"
