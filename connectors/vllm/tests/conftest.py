"""Fixtures: a real ``kvgate-kvbm`` daemon on a private socket (no NATS: it serves connectors
while it retries NATS, as it does in production when NATS is away)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "connectors" / "vllm" / "src"))


def kvbm_binary() -> Path:
    explicit = os.environ.get("KVGATE_KVBM_BIN")
    if explicit:
        return Path(explicit)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug" / "kvgate-kvbm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(
        self, tmp: Path, model: str = "m", block_size: int = 4, host_bytes: int = 64 << 20
    ) -> None:
        binary = kvbm_binary()
        if not binary.is_file():
            raise FileNotFoundError(
                f"{binary} not found: build it with `cargo build -p kvgate-kvbm` or set KVGATE_KVBM_BIN"
            )
        self.binary = binary
        self.socket = str(tmp / "kvbm.sock")
        self.args = [
            "--socket", self.socket,
            "--metrics-bind", "127.0.0.1",
            "--node", "n1",
            "--model", model,
            "--block-size", str(block_size),
            "--nats-url", f"nats://127.0.0.1:{free_port()}",
            "--host-bytes", str(host_bytes),
        ]
        self.log = tmp / "kvbm.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), *self.args, "--metrics-port", str(free_port())],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate-kvbm exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"kvgate-kvbm did not listen on {self.socket}: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def daemon(tmp_path: Path):
    d = Daemon(tmp_path)
    yield d
    d.stop()
