"""Load test of `dflash2 serve` over real HTTP: C good clients (greedy and sampled, streaming and not) for D
seconds while one bad client sends requests that must be refused (or, for a tiny temperature, served greedily);
counts failed good requests, the bad ones' statuses and samples the server's resident memory every second.

    PYTHONPATH=src python scripts/load_serve.py --model smollm2-135m-instruct --clients 16 --seconds 60 \\
        --out runs/load-smollm2.json

Passes (exit 0) when no good request failed and the resident memory at the end is within --rss-slack-mb of its
level after the warm-up (the first 20% of the run); the JSON report holds every count and the RSS samples.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
QUESTIONS = [
    "Write a Python function that reverses a string.", "What is 17 times 23? Answer briefly.",
    "List three uses of a hash map.", "Explain recursion in two sentences.",
    "Write a SQL query counting rows per day.", "Name the planets of the solar system.",
]


def bad_requests(model: str) -> list[tuple[str, dict, bytes | None, dict]]:
    """(label, JSON body or None, raw body or None, extra headers): each must get a 4xx or a proper reply."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    return [
        ("tiny-temperature", chat | {"temperature": 1e-40}, None, {}),  # served as greedy
        ("huge-seed", chat | {"seed": 2**70, "temperature": 0.7}, None, {}),
        ("malformed-json", None, b'{"model": "x", "messages": [', {}),
        ("text-plain", None, json.dumps(chat).encode(), {"content-type": "text/plain"}),
        ("foreign-origin", chat, None, {"origin": "https://evil.example"}),
        ("huge-max-tokens", chat | {"max_tokens": 10**9}, None, {}),
        ("unknown-drafter", chat | {"dflash2": {"drafter": "nope"}}, None, {}),
        ("draft-length-over-cap", chat | {"dflash2": {"num_draft_tokens": 64}}, None, {}),
        ("negative-top-p", chat | {"top_p": -1}, None, {}),
        ("empty-messages", chat | {"messages": []}, None, {}),
    ]


class Server:
    """`dflash2 serve --model MODEL EXTRA...` on a free loopback port, or ``command(port)`` (another server that
    answers GET /health with 200 once ready: scripts/bench_http.py's llama-server), started and waited for."""

    def __init__(self, model: str, extra: list[str], command: Callable[[int], list[str]] | None = None) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": SRC}
        if command is None:
            argv = [sys.executable, "-m", "dflash2.cli", "serve", "--model", model, "--port", str(self.port), *extra]
        else:
            argv = command(self.port)
        # (a file, not a pipe: a server that logs every request would fill a pipe nobody reads and stall)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited: {self.log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not start")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def good_client(server: Server, model: str, stop_at: float, seed: int, out: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=server.url, timeout=300) as client:
        while time.monotonic() < stop_at:
            sampled, stream = rng.random() < 0.5, rng.random() < 0.5
            body = {"model": model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                    "max_tokens": rng.randint(16, 64), "temperature": 0.8 if sampled else 0.0, "stream": stream}
            if sampled and rng.random() < 0.5:
                body["seed"] = rng.randint(0, 2**31)
            started = time.monotonic()
            try:
                ok, tokens = _good_call(client, body, stream)
            except httpx.HTTPError as error:
                ok, tokens = False, 0
                with lock:
                    out["errors"].append(f"{type(error).__name__}: {error}")
            with lock:
                out["good_ok" if ok else "good_failed"] += 1
                out["tokens"] += tokens
                out["latencies"].append(time.monotonic() - started)


def _good_call(client: httpx.Client, body: dict, stream: bool) -> tuple[bool, int]:
    if not stream:
        response = client.post("/v1/chat/completions", json=body)
        reply = response.json()
        return response.status_code == 200 and "choices" in reply, reply.get("usage", {}).get("completion_tokens", 0)
    events = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return False, 0
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if '"error"' in line:
                    return False, events
                events += 1
    return True, max(events - 2, 0)  # the role chunk and the finish chunk carry no token


def bad_client(server: Server, model: str, stop_at: float, every_s: float, out: Counter) -> None:
    requests = bad_requests(model)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        index = 0
        while time.monotonic() < stop_at:
            label, body, raw, headers = requests[index % len(requests)]
            index += 1
            if body is not None:
                response = client.post("/v1/chat/completions", json=body, headers=headers)
            else:
                headers = {"content-type": "application/json"} | headers
                response = client.post("/v1/chat/completions", content=raw, headers=headers)
            out[f"{label}:{response.status_code}"] += 1
            time.sleep(every_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--bad-every", type=float, default=2.0, help="seconds between the bad client's requests")
    parser.add_argument("--rss-slack-mb", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="extra `dflash2 serve` arguments (after --)")
    args = parser.parse_args()

    server = Server(args.model, args.serve_args)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        lock = threading.Lock()
        good = {"good_ok": 0, "good_failed": 0, "tokens": 0, "latencies": [], "errors": []}
        bad: Counter = Counter()
        started = time.monotonic()
        stop_at = started + args.seconds
        threads = [threading.Thread(target=good_client, args=(server, model, stop_at, i, good, lock))
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=bad_client, args=(server, model, stop_at, args.bad_every, bad)))
        for thread in threads:
            thread.start()
        rss = []
        while any(t.is_alive() for t in threads):
            rss.append((round(time.monotonic() - started, 1), round(server.rss_mb(), 1)))
            time.sleep(1.0)
        elapsed = time.monotonic() - started
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
    finally:
        server.stop()
    warm = [mb for t, mb in rss if t >= 0.2 * args.seconds] or [mb for _, mb in rss]
    report = {
        "model": args.model, "clients": args.clients, "seconds": round(elapsed, 1), "serve_args": args.serve_args,
        "good_ok": good["good_ok"], "good_failed": good["good_failed"], "errors": good["errors"][:20],
        "tokens_per_s": round(good["tokens"] / elapsed, 2),
        "latency_s_median": round(statistics.median(good["latencies"]), 2) if good["latencies"] else None,
        "bad": dict(sorted(bad.items())), "health_after": health,
        "rss_mb_after_warmup": warm[0], "rss_mb_peak": max(mb for _, mb in rss), "rss_mb_end": rss[-1][1],
        "rss_samples": rss, "metrics_tail": [line for line in metrics.splitlines() if "requests_finished" in line],
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))
    flat = report["rss_mb_end"] - report["rss_mb_after_warmup"] <= args.rss_slack_mb
    return 0 if report["good_failed"] == 0 and flat and health == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
