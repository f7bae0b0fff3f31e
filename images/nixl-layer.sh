#!/usr/bin/env bash
# Builds the NIXL layer of the kvgate-kvbm-nixl image: NIXL 1.5.1's C API, its UCX backend
# plugin and UCX, from the PyPI wheel nixl-cu12 (checksum verified; the wheel is unpacked, not
# installed: no Python is used), under DIR/opt/nixl, in the wheel's own layout (lib/ beside
# nixl_cu12.libs/, which the libraries' RPATHs expect):
#
#   DIR/opt/nixl/lib/libnixl_capi.so   what kvgate-kvbm --nixl-library opens
#   DIR/opt/nixl/lib/plugins/          the UCX plugin only (NIXL looks beside libnixl.so)
#   DIR/opt/nixl/nixl_cu12.libs/       UCX, its transports, and what the two need
#   DIR/opt/nixl/LICENSES/             the wheel's licence files
#
# Only what the C API and the UCX plugin load is taken (their NEEDED entries, followed), and of
# UCX's transport modules those that load with no library outside the layer and the image's
# root but the NVIDIA driver's (which the container toolkit mounts on GPU nodes): shared memory
# (CMA), InfiniBand/RoCE verbs and mlx5, and CUDA. The others (EFA, GPUDirect-over-flexio, the
# perftest modules) need libraries the image does not carry; UCX skips a module that does not
# load. The C API itself needs libssl3 and zlib1g from the root (scripts/images.sh adds them).
#
#   images/nixl-layer.sh DIR
#
# Downloads the wheel with pip (PyPI, or the index pip is configured with). Needs python3 (pip,
# zipfile) and readelf (binutils). Used by scripts/images.sh and by images/Dockerfile's nixl
# stage.
set -euo pipefail

say() { printf 'nixl-layer: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

[ $# -eq 1 ] || die "usage: images/nixl-layer.sh DIR"
dest=$1
version=1.5.1
# The wheel's SHA-256, as scripts/bootstrap.sh checks it.
sha=341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a
for tool in python3 readelf; do
  command -v "$tool" >/dev/null || die "$tool is missing (Debian packages python3-pip, binutils)"
done
if [ -e "$dest/opt/nixl" ]; then die "$dest/opt/nixl exists"; fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say "downloading nixl-cu12 $version from PyPI (about 70 MB)"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$tmp" "nixl-cu12==$version"
whl=$(echo "$tmp"/nixl_cu12-"$version"-*.whl)
echo "$sha  $whl" | sha256sum -c --quiet - || die "$whl: checksum mismatch"
python3 -m zipfile -e "$whl" "$tmp/unpacked"
src="$tmp/src"
mkdir -p "$src"
mv "$tmp/unpacked/.nixl_cu12.mesonpy.libs" "$src/lib"
mv "$tmp/unpacked/nixl_cu12.libs" "$src/nixl_cu12.libs"

# The files to take: the roots, then every library they name (NEEDED) that the wheel carries,
# followed to the end. Names are looked up where the RPATHs point: lib/, lib/plugins/ and
# nixl_cu12.libs/.
roots=(lib/libnixl_capi.so lib/plugins/libplugin_UCX.so)
for m in uct_cma uct_ib uct_ib_mlx5 uct_ib_mlx5_ext uct_cuda; do
  roots+=("nixl_cu12.libs/ucx/lib$m.so.0.0.0")
done
declare -A take=()
queue=("${roots[@]}")
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]}
  queue=("${queue[@]:1}")
  [ -z "${take[$f]:-}" ] || continue
  [ -f "$src/$f" ] || die "the wheel has no $f"
  take[$f]=1
  while read -r needed; do
    for d in lib lib/plugins nixl_cu12.libs; do
      if [ -f "$src/$d/$needed" ]; then
        queue+=("$d/$needed")
        break
      fi
    done
  done < <(readelf -d "$src/$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
done

mkdir -p "$dest/opt/nixl/LICENSES"
for f in "${!take[@]}"; do
  install -D -m 0644 "$src/$f" "$dest/opt/nixl/$f"
done
# The licences of NIXL and of what its wheel bundles (UCX, gRPC, Abseil, protobuf, ...).
while IFS= read -r f; do
  install -m 0644 "$f" "$dest/opt/nixl/LICENSES/$(basename "$f")"
done < <(find "$tmp/unpacked" -path '*.dist-info/*' -type f \( -iname 'LICENSE*' -o -iname 'COPYING*' -o -iname 'NOTICE*' \))
[ -n "$(ls -A "$dest/opt/nixl/LICENSES")" ] || die "the wheel has no licence file"
find "$dest/opt" -type d -exec chmod 0755 {} +
say "done: ${#take[@]} libraries, $(du -sh --apparent-size "$dest/opt/nixl" | cut -f1) in $dest/opt/nixl"
