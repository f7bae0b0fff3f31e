"""The connector in a real vLLM 0.32 (CPU, tiny random-weight Qwen3; ../shared/scripts/real-vllm)
against a real kvgate-kvbm: a prefix evicted from vLLM's cache comes back from the daemon.

Run by scripts/test-real-engine.sh with the vLLM environment's Python. Each test needs one vLLM
server (~4.5 GiB of memory, about a minute to start)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, Daemon, free_port

SHARED = Path(os.environ.get("KVGATE_SHARED", ROOT.parent / "shared"))
SERVE = SHARED / "scripts" / "real-vllm" / "serve.sh"
BLOCK = 32
GPU_BLOCKS = 100  # 3,200 tokens: eight 1,300-token fillers evict everything


class Vllm:
    def __init__(self, tmp: Path, socket: str) -> None:
        if not SERVE.is_file():
            raise FileNotFoundError(f"{SERVE} not found; set KVGATE_SHARED")
        self.port = free_port()
        config = {
            "kv_connector": "KvgateConnector",
            "kv_connector_module_path": "kvgate_vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket, "retry_s": 0.5, "max_retry_s": 1.0},
        }
        env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "vllm" / "src"), TMPDIR=str(tmp))
        self.log = tmp / "vllm.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    "bash", str(SERVE), "--port", str(self.port),
                    "--events-port", str(free_port()), "--replay-port", str(free_port()),
                    "--num-gpu-blocks", str(GPU_BLOCKS),
                    "--extra", "--enable-prompt-tokens-details",
                    "--kv-transfer-config", json.dumps(config),
                ],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM was not ready within 300 s; see {self.log}")

    def complete(self, prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def eventually(what: str, cond, timeout_s: float = 10.0) -> None:
    """vLLM's frontend records the connector's stats a little after the step."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def words(seed: int, n: int = 300) -> str:
    rnd = random.Random(seed)
    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
    return " ".join(f"{rnd.choice(names)}{rnd.randint(0, 999)}" for _ in range(n))


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def logprobs(response: dict) -> list[float]:
    return response["choices"][0]["logprobs"]["token_logprobs"]


def evict(engine: Vllm, seed: int) -> None:
    for i in range(8):
        engine.complete(words(seed + i))


@pytest.fixture
def stack(tmp_path: Path):
    daemon = Daemon(tmp_path, model="tiny", block_size=BLOCK, host_bytes=1 << 30)
    engine = Vllm(tmp_path, daemon.socket)
    yield daemon, engine
    engine.stop()
    daemon.stop()


def test_a_prefix_evicted_from_vllm_comes_back_from_the_block_manager(stack):
    daemon, engine = stack
    prompt = words(1)
    first = engine.complete(prompt)
    tokens = first["usage"]["prompt_tokens"]
    assert cached(first) == 0
    evict(engine, 100)
    hits_before = engine.metric("vllm:external_prefix_cache_hits_total")

    again = engine.complete(prompt)
    # Every full block but the one holding the last prompt token came from the daemon.
    expected = (tokens - 1) // BLOCK * BLOCK
    assert cached(again) == expected, again["usage"]
    assert engine.metric("vllm:external_prefix_cache_hits_total") - hits_before == expected
    # The loaded KV is the computed KV: the same log-probabilities to the last bit ...
    assert logprobs(again) == logprobs(first)
    # ... where a prompt differing in its first word gives other values (so the check has power).
    other = engine.complete("zulu" + prompt[5:])
    assert logprobs(other) != logprobs(first)
    # The connector's own counters reach vLLM's Prometheus endpoint.
    eventually(
        "vllm:kvgate_loaded_blocks_total",
        lambda: engine.metric("vllm:kvgate_loaded_blocks_total") >= expected // BLOCK,
    )
    assert engine.metric("vllm:kvgate_offloaded_blocks_total") >= 9 * (tokens // BLOCK)
    assert engine.metric("vllm:kvgate_load_failed_blocks_total") == 0


def test_a_daemon_restart_loses_no_request_and_the_connector_reconnects(stack):
    daemon, engine = stack
    prompt = words(2)
    engine.complete(prompt)
    daemon.stop()
    # With the daemon gone requests are served by recomputing; offloads are dropped.
    evict(engine, 200)
    during = engine.complete(prompt)
    assert cached(during) == 0
    eventually(
        "lookups and offloads counted as failed while the daemon is away",
        lambda: engine.metric("vllm:kvgate_lookups_failed_total") >= 1
        and engine.metric("vllm:kvgate_offload_dropped_blocks_total") >= 1,
    )
    daemon.start()  # empty: its blocks did not survive
    time.sleep(1.5)  # past the connector's back-off (at most 1 s here)
    engine.complete(prompt)  # computed again, and offloaded to the new daemon
    evict(engine, 300)
    after = engine.complete(prompt)
    assert cached(after) == (after["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert logprobs(after) == logprobs(during)
