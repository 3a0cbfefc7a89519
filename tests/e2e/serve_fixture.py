"""A live ``dflash2 serve`` subprocess on 127.0.0.1 (a free port) for tests with real HTTP clients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *extra: str, api_key: str = "test-key", timeout: float = 180.0) -> LiveServer:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "DFLASH2_API_KEY": api_key}
    command = [sys.executable, "-m", "dflash2.cli", "serve", "--model", model, "--port", str(port), *extra]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    server = LiveServer(process, f"http://127.0.0.1:{port}", api_key, model)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


def stop_server(server: LiveServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(5)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def spread_ids(n: int, vocab: int) -> list[int]:
    """n token ids spread over [100, vocab + 100) with little repetition: a long prompt whose tokens are all valid ids
    and that prompt lookup cannot shortcut."""
    return [100 + (i * 7919) % vocab for i in range(n)]
