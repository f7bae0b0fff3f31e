#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer, AddressSanitizer) of every target in
# fuzz/fuzz_targets/: decode (KV-event payloads, ZMQ frames, replay replies, NATS envelopes),
# ext_proc (the EPP's per-stream ext_proc state machine), request_body (the EPP's body parser,
# keyer and model rewrite), connector_frames (the block manager's connector protocol) and
# proxy_body (the sidecar's P/D proxy bodies).
#
#   scripts/fuzz.sh [seconds] [target...]    each target for that long (default 60 s; all targets)
#   scripts/fuzz.sh --runs N [target...]     each target until N executions (corpus replay included)
#   scripts/fuzz.sh --fork J (seconds | --runs N) [target...]
#                                            the same, each target as one libFuzzer run in fork
#                                            mode: J worker processes on one shared corpus, the
#                                            executions and the limit counted over all of them
#
# CI runs `scripts/fuzz.sh 30`. Prints per target the executions and exec/s libFuzzer reports,
# and exits 1 if any target crashed (its reproducer is under fuzz/artifacts/<target>/; replay it
# with `cargo fuzz run <target> <file>` in fuzz/). Corpora are kept in fuzz/corpus/<target>/,
# seeded from ../shared/fixtures and a few generated bodies when empty.
#
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly compiler flags: it uses a nightly
# toolchain when one is installed, else the pinned stable one with RUSTC_BOOTSTRAP=1. With
# CARGO_TARGET_DIR set (as in CI), the fuzz build goes to $CARGO_TARGET_DIR/fuzz.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root/fuzz"

usage() { sed -n '8,13p' "$root/scripts/fuzz.sh" | sed 's/^# \{0,1\}//' >&2; exit 2; }
limit=(-max_total_time=60)
fork=()
if [ "${1:-}" = "--fork" ]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || usage
  fork=(-fork="$2")
  shift 2
fi
if [ "${1:-}" = "--runs" ]; then
  [[ "${2:-}" =~ ^[0-9]+$ ]] || usage
  limit=(-runs="$2")
  shift 2
elif [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  limit=(-max_total_time="$1")
  shift
elif [[ "${1:-}" == -* ]]; then
  usage
fi

cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  fuzz() { cargo +nightly fuzz "$@"; }
else
  fuzz() { RUSTC_BOOTSTRAP=1 cargo fuzz "$@"; }
fi
[ -n "${CARGO_TARGET_DIR:-}" ] && export CARGO_TARGET_DIR="$CARGO_TARGET_DIR/fuzz"

mapfile -t all < <(fuzz list)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "fuzz: no target $t (have: ${all[*]})" >&2; exit 2; }
done

# Seed the empty corpora: captured engine payloads (decode), the request bodies sent to the
# captured vLLM (request_body, proxy_body), and a few generated bodies and connector frames.
shared=${KVGATE_SHARED:-$root/../shared}
python3 - "$shared/fixtures" "$root/fuzz/corpus" <<'PY'
import base64, hashlib, json, pathlib, struct, sys
src, corpus = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

def seed(target, items):
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    if any(d.iterdir()):
        return
    for b in items:
        (d / hashlib.sha1(b).hexdigest()).write_bytes(b)

frames, bodies = [], []
if src.is_dir():
    for f in sorted(src.rglob("frames*.jsonl")):
        for line in f.read_text().splitlines():
            frames.append(base64.b64decode(json.loads(line)["frames_b64"][2]))
    for f in sorted(src.rglob("requests*.json")):
        for r in json.loads(f.read_text()).get("requests", []):
            if isinstance(r.get("body"), dict):
                bodies.append((r.get("path", "").endswith("/chat/completions"), r["body"]))
chat = lambda msgs, **kw: (True, {"model": "m", "messages": msgs, **kw})
bodies += [
    (False, {"model": "m", "prompt": "Hello there, how are you today?", "max_tokens": 8,
             "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "s"}),
    (False, {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}),
    (False, {"prompt": ["first text", "second"], "user": "u", "n": 2}),
    (False, {"prompt": [[5, 6, 7], [8]], "kv_transfer_params": {"do_remote_prefill": True}}),
    chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]),
    chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         max_completion_tokens=3, chat_template_kwargs={"enable_thinking": False}),
    chat([{"role": "user", "content": "weather?"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "cold"}],
         tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}]),
    chat([{"role": "user", "content": "Continue:"}, {"role": "assistant", "content": "Once"}],
         add_generation_prompt=False, continue_final_message=True, n=3),
    (True, {"model": "qwen3", "messages": [{"role": "user", "content": "Hello, Qwen."}]}),
    (False, {"model": "qwen3", "prompt": "Hello, Qwen. " * 20}),
]
enc = [(c, json.dumps(b).encode()) for c, b in bodies]
seed("decode", frames)
# request_body: option bytes (bit 0 of the first: chat), then the body.
seed("request_body", [bytes([int(c), 0]) + b for c, b in enc])
# proxy_body: option byte, header, 0xff, body, 0xff, the prefill response.
resp = json.dumps({"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
    "remote_engine_id": "e", "remote_host": "10.0.0.7", "remote_port": 5600}}).encode()
headers = [b"10.0.0.7:8000", b"[fd00::7]:8000, 10.0.0.8:8000", b"evil.example:80", b""]
seed("proxy_body", [bytes([int(c) | (i << 1)]) + headers[i % 4] + b"\xff" + b + b"\xff" + resp
                    for i, (c, b) in enumerate(enc)])

# connector_frames: MessagePack maps with field names, each behind its 4-byte length.
def mp(v):
    if v is None: return b"\xc0"
    if isinstance(v, bool): return b"\xc3" if v else b"\xc2"
    if isinstance(v, int): return b"\xcf" + struct.pack(">Q", v) if v > 127 else bytes([v])
    if isinstance(v, str):
        s = v.encode(); return bytes([0xa0 | len(s)]) + s
    if isinstance(v, list): return bytes([0x90 | len(v)]) + b"".join(map(mp, v))
    return bytes([0x80 | len(v)]) + b"".join(mp(k) + mp(x) for k, x in v.items())
frame = lambda m: struct.pack(">I", len(mp(m))) + mp(m)
layout = {"model": "m", "dtype": "fp8", "layers": 2, "block_size": 16, "block_bytes": 4096,
          "shard": 0, "shards": 1}
slots = [{"key": 11, "offset": 0}, {"key": 12, "offset": 4096}]
session = [{"op": "register", "layout": layout, "segment_bytes": 1 << 20},
           {"op": "offload", "parent": None, "blocks": slots},
           {"op": "lookup", "keys": [11, 12, 13], "pin_ms": 100},
           {"op": "onboard", "blocks": slots}, {"op": "unpin", "keys": [11]}]
answers = [{"op": "registered", "layout_id": 0},
           {"op": "offloaded", "stored": 2, "present": 0, "skipped": 0},
           {"op": "found", "host": 2, "any": 2, "pinned": 2},
           {"op": "onboarded", "blocks": 2, "from_host": 2, "from_disk": 0, "from_remote": 0},
           {"op": "error", "code": "slot", "message": "outside"}]
peer = [{"op": "hello", "node": "a", "nonce": [7] * 32},
        {"op": "auth", "node": "b", "nonce": [9] * 32, "mac": [1] * 32},
        {"op": "welcome", "mac": [2] * 32}, {"op": "pull", "layout": layout, "keys": [11, 12]},
        {"op": "blocks", "block_bytes": 4096, "sums": [5, 6], "parent": 10},
        {"op": "refused", "message": "no"}]
seed("connector_frames", [b"".join(map(frame, session)), b"".join(map(frame, answers)),
                          b"".join(map(frame, peer))]
     + [frame(m) for m in session + answers + peer])
seed("ext_proc", [])
PY

# One build for every target (release, debug assertions, AddressSanitizer).
echo "fuzz: building ${#all[@]} targets"
fuzz build

failed=()
summary=()
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
for t in "${targets[@]}"; do
  echo "fuzz: $t (${limit[*]}${fork:+ ${fork[*]}})"
  status=0
  # No leak checks: the targets keep one-time state and caches (the real tokenizer, its segment
  # cache), which libFuzzer's malloc/free count takes for a possible leak, and each check scans
  # the whole heap (it halved request_body's rate). Safe Rust leaks only on purpose.
  fuzz run "$t" "$root/fuzz/corpus/$t" -- "${limit[@]}" "${fork[@]}" -timeout=30 \
    -detect_leaks=0 -print_final_stats=1 >"$log/$t" 2>&1 || status=$?
  runs=$(awk '/^stat::number_of_executed_units:/ {print $2}' "$log/$t" | tail -1)
  rate=$(awk '/^stat::average_exec_per_sec:/ {print $2}' "$log/$t" | tail -1)
  if [ -z "$runs" ]; then
    # Fork mode prints no final stats: its last progress line counts every worker's executions
    # (`#N: ... exec/s: R ...`).
    runs=$(awk '/^#[0-9]+:/ {sub(/^#/, "", $1); sub(/:$/, "", $1); n = $1} END {print n}' "$log/$t")
    rate=$(awk '/^#[0-9]+:/ {for (i = 1; i < NF; i++) if ($i == "exec/s:") r = $(i + 1)} END {print r}' "$log/$t")
  fi
  corpus=$(find "$root/fuzz/corpus/$t" -type f | wc -l)
  line=$(printf '%-17s %12s execs %8s exec/s  corpus %6s' "$t" "${runs:-?}" "${rate:-?}" "$corpus")
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log/$t"
    line="$line  CRASHED (exit $status)"
    failed+=("$t")
  fi
  echo "fuzz: $line"
  summary+=("$line")
done
echo "fuzz: summary"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashed: ${failed[*]} (reproducers in fuzz/artifacts/)" >&2
  exit 1
fi
