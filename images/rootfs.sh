#!/usr/bin/env bash
# Builds the root filesystem kvgate's images run on, distroless/cc-style: the files of Debian
# bookworm's libc6, libgcc-s1 and libstdc++6 (and of any package named, with its dependencies)
# extracted from Debian's packages without running any package script; Mozilla's CA roots as
# /etc/ssl/certs/ca-certificates.crt (from ca-certificates, as update-ca-certificates writes
# it); os-release and debian_version (from base-files); passwd and group with root and nonroot
# (65532); a dpkg status.d entry per package taken, for image scanners. No shell, no package
# manager, no setuid file, no device node.
#
#   images/rootfs.sh DIR [PACKAGE...]
#
# Used by scripts/images.sh on the host and by images/Dockerfile's rootfs stage. Needs root,
# mmdebstrap, apt and dpkg-deb, and the Debian mirrors (KVGATE_DEBIAN_MIRROR, default
# http://deb.debian.org/debian; KVGATE_DEBIAN_SECURITY_MIRROR, default
# http://deb.debian.org/debian-security). The packages are bookworm's newest, security updates
# included; the architecture is the host's.
set -euo pipefail

say() { printf 'rootfs: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# Records a package in var/lib/dpkg/status.d/<name>, the layout distroless uses and scanners
# (trivy, grype, syft) read in place of var/lib/dpkg/status.
record() {
  local root=$1 deb=$2 name
  name=$(dpkg-deb --field "$deb" Package)
  dpkg-deb --field "$deb" |
    awk '{ print } /^Package:/ { print "Status: install ok installed" }' \
      > "$root/var/lib/dpkg/status.d/$name"
}

# mmdebstrap runs this script again as its extract hook (MMDEBSTRAP_HOOK=extract), with the
# root as $1, after it has extracted the packages and while their .deb files are still there.
extract_hook() {
  local root=$1 deb tmp f
  mkdir -p "$root/var/lib/dpkg/status.d"
  for deb in "$root"/var/cache/apt/archives/*.deb; do
    record "$root" "$deb"
  done
  # Only a few files of these two: ca-certificates depends on openssl and debconf (perl), and
  # its bundle is written by its postinst, which an extracted root never runs.
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: $tmp is local
  trap "rm -rf '$tmp'" EXIT
  (cd "$tmp" && APT_CONFIG=$MMDEBSTRAP_APT_CONFIG apt-get download -qq -o APT::Sandbox::User=root ca-certificates base-files)
  for deb in "$tmp"/*.deb; do
    dpkg-deb --extract "$deb" "$tmp/x"
    record "$root" "$deb"
  done
  mkdir -p "$root/etc/ssl/certs" "$root/usr/lib" \
    "$root/usr/share/doc/ca-certificates" "$root/usr/share/doc/base-files"
  # update-ca-certificates' bundle: every certificate of /etc/ca-certificates.conf (by default
  # all of mozilla/, in name order), each ending in a newline.
  for f in "$tmp"/x/usr/share/ca-certificates/mozilla/*.crt; do
    cat "$f"
    [ -z "$(tail -c 1 "$f")" ] || echo
  done > "$root/etc/ssl/certs/ca-certificates.crt"
  cp "$tmp/x/usr/lib/os-release" "$root/usr/lib/os-release"
  ln -sf ../usr/lib/os-release "$root/etc/os-release"
  cp "$tmp/x/etc/debian_version" "$root/etc/debian_version"
  cp "$tmp/x/usr/share/doc/ca-certificates/copyright" "$root/usr/share/doc/ca-certificates/"
  cp "$tmp/x/usr/share/doc/base-files/copyright" "$root/usr/share/doc/base-files/"
}

if [ "${MMDEBSTRAP_HOOK:-}" = extract ]; then
  extract_hook "$1"
  exit 0
fi

[ $# -ge 1 ] || die "usage: images/rootfs.sh DIR [PACKAGE...]"
dir=$1
shift
[ "$(id -u)" -eq 0 ] || die "needs root (the files must be owned by root)"
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then die "$dir is not empty"; fi
for tool in mmdebstrap apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || die "$tool is missing (Debian packages mmdebstrap, apt, dpkg)"
done
self=$(readlink -f "${BASH_SOURCE[0]}")
mirror=${KVGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${KVGATE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# libstdc++6: the binaries that link C++ (libzmq, which zmq-sys builds from source and links
# statically; tokenizers' esaxx) need it at run time; the Rust runtime needs libgcc_s.
include=libc6,libgcc-s1,libstdc++6
for pkg in "$@"; do include="$include,$pkg"; done

# chrootless + extract: apt resolves and downloads, dpkg-deb extracts; nothing is run inside the
# root and nothing is mounted, so this works as plain root in a container build too. (The
# warning mmdebstrap prints about chrootless mode concerns package scripts, which extract skips.)
say "extracting bookworm packages: ${include//,/ } (and their dependencies)"
mmdebstrap --quiet --mode=chrootless --variant=extract --include="$include" \
  --extract-hook="$self" bookworm "$dir" \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
  "deb $security bookworm-security main"

cd "$dir"
# What mmdebstrap leaves for a chroot, and what a container runtime provides (/dev, resolv.conf,
# hostname): not part of an image.
rm -rf dev etc/apt etc/fstab etc/hostname etc/resolv.conf var/cache var/log var/lib/apt
find var/lib/dpkg -mindepth 1 -maxdepth 1 ! -name status.d -exec rm -rf {} +
# Documentation but the copyright files; debugger and lintian support files; glibc's iconv
# modules (gconv), which Rust programs never load.
rm -rf usr/share/man usr/share/info usr/share/locale usr/share/lintian usr/share/gdb \
  usr/share/gcc usr/lib/*/gconv
find usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
find usr/share/doc -mindepth 1 -type d -empty -delete

# The user every kvgate pod runs as (runAsUser/runAsGroup 65532), as distroless names it.
mkdir -p etc home/nonroot tmp
printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
  'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' > etc/passwd
printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' > etc/group
# Host names from /etc/hosts (which the runtime mounts) before DNS.
printf 'hosts: files dns\n' > etc/nsswitch.conf
chmod 0644 etc/passwd etc/group etc/nsswitch.conf
chown 65532:65532 home/nonroot
chmod 0700 home/nonroot
chmod 1777 tmp
say "done: $dir ($(du -sh --apparent-size . | cut -f1), $(find var/lib/dpkg/status.d -type f | wc -l) packages)"
