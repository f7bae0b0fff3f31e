#!/usr/bin/env bash
# Keeps a cargo target directory shared between checkouts (CI's $HOME/.cache/kvgate-target) from
# growing without bound. Each checkout path builds its test, bench and fuzz executables under new
# hashes, and nothing removes the old ones: at ~190 MB per test binary a few CI runs filled a
# machine's disk. This removes every executable in <target>/<profile>/deps that a newer build of
# the same name replaced, and says how much it freed. Cargo rebuilds nothing it still needs: the
# newest executable of each name stays, and libraries are never touched.
#
#   scripts/prune-target.sh [target-dir]   (default: $CARGO_TARGET_DIR, else ./target)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-${CARGO_TARGET_DIR:-$root/target}}
freed=0
removed=0
for deps in "$dir"/*/deps "$dir"/*/*/release/deps; do
  [ -d "$deps" ] || continue
  # Newest first; a name is the file name without its trailing -<hash>.
  while read -r size file; do
    rm -f -- "$deps/$file"
    freed=$((freed + size))
    removed=$((removed + 1))
  done < <(find "$deps" -maxdepth 1 -type f -perm -u+x ! -name '*.so' -printf '%T@ %s %f\n' \
    | sort -rn \
    | awk '{ name = $3; sub(/-[0-9a-f]+$/, "", name); if (seen[name]++) print $2, $3 }')
done
printf 'prune-target: removed %d stale executables (%d MB) from %s\n' \
  "$removed" "$((freed / 1000000))" "$dir"
