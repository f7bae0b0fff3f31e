#!/usr/bin/env bash
# Keeps a cargo target directory shared between checkouts (CI's $HOME/.cache/kvgate-target) from
# growing without bound. A checkout at another path, a changed lock file or profile builds the
# same test, bench and binary targets under new hashes, and nothing removes the old ones: at
# ~190 MB per test binary a few CI runs filled a machine's disk.
#
# In each <profile>/deps directory this keeps, of the executables built for one target (the same
# name, the same kind in cargo's fingerprint: bin, test-bin, test-lib, test-integration-test,
# bench…, and the same root source file), the newest, and removes the others. Libraries are never
# touched, so cargo rebuilds no library; a second checkout sharing the directory relinks its own
# executables once after the other one built. Each directory is pruned under cargo's own lock
# (`<profile>/.cargo-lock`), so a build running in it finishes first.
#
#   scripts/prune-target.sh [target-dir]   (default: $CARGO_TARGET_DIR, else ./target)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-${CARGO_TARGET_DIR:-$root/target}}
[ -d "$dir" ] || { echo "prune-target: no target directory at $dir"; exit 0; }
for tool in python3 flock; do
  command -v "$tool" >/dev/null 2>&1 || { echo "prune-target: $tool missing; nothing pruned"; exit 0; }
done
for profile in "$dir"/*/ "$dir"/*/*/release/; do
  profile=${profile%/}
  [ -d "$profile/deps" ] && [ -d "$profile/.fingerprint" ] || continue
  touch "$profile/.cargo-lock"
  flock -w 900 "$profile/.cargo-lock" python3 - "$profile" <<'PY'
import os, re, sys

profile = sys.argv[1]
deps = os.path.join(profile, "deps")
fingerprints = os.path.join(profile, ".fingerprint")
# A fingerprint directory is <package>-<hash>; the artifact deps/<target>-<hash> shares the hash.
by_hash = {}
for entry in os.listdir(fingerprints):
    m = re.fullmatch(r".+-([0-9a-f]{16})", entry)
    if m:
        by_hash[m.group(1)] = os.path.join(fingerprints, entry)

def kind(hash_):
    """The target's kind and name as cargo's fingerprint files spell them ('test-bin-kvgate-epp')."""
    d = by_hash.get(hash_)
    if d is None:
        return "?"
    names = [f for f in os.listdir(d) if not f.endswith(".json") and not f.startswith("dep-")
             and f != "invoked.timestamp"]
    return ",".join(sorted(names)) or "?"

def root_source(path):
    """The first source file of the artifact's dep-info: the target's root (src/main.rs…)."""
    try:
        with open(path + ".d", encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return "?"
    _, _, sources = first.partition(": ")
    return sources.split(" ", 1)[0].strip() or "?"

groups = {}
for f in os.listdir(deps):
    m = re.fullmatch(r"(.+)-([0-9a-f]{16})", f)
    path = os.path.join(deps, f)
    if not m or not os.path.isfile(path) or not os.access(path, os.X_OK):
        continue
    key = (m.group(1), kind(m.group(2)), root_source(path))
    groups.setdefault(key, []).append((os.path.getmtime(path), path))

removed = freed = 0
for files in groups.values():
    files.sort(reverse=True)
    for _, path in files[1:]:
        freed += os.path.getsize(path)
        os.remove(path)
        removed += 1
print(f"prune-target: {profile}: removed {removed} replaced executables ({freed // 1_000_000} MB)")
PY
done
