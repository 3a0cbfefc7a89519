"""Load test and soak of `dflash2 serve` over real HTTP: C good clients (greedy and sampled, streaming and not,
short and long prompts, some streams cancelled after their first tokens) for D seconds while one bad client sends
requests that must be refused (or, for a tiny temperature, served greedily); counts failed good requests, the bad
ones' statuses, p50 / p99 latency, generated tokens/s, and samples the server's resident memory every second.

    PYTHONPATH=src .venv/bin/dflash2 bench serve load --model smollm2-135m-instruct --clients 16 --seconds 60 \\
        --out runs/load-smollm2.json
    # the soak: 30 minutes, memory compared from minute 5, then a SIGKILL mid-request and a restart on the store
    PYTHONPATH=src nice -n 15 .venv/bin/dflash2 bench serve load --model smollm2-135m-instruct --clients 8 \\
        --seconds 1800 --warmup-seconds 300 --kill-restart --out runs/soak-smollm2.json

Passes (exit 0) when no good request failed, /health answers 200 at the end, the resident memory (median of the
last 30 s) is within --rss-growth-pct of its level after the warm-up (median of the 30 s from --warmup-seconds,
default 20% of the run up to 5 minutes), and, with --kill-restart, a server started again on the same store after a
SIGKILL in the middle of a streamed request serves a request and the store verifies (`dflash2 models verify`, no
``.part`` file left beside the model). The JSON report holds every count and the RSS samples.
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

SRC = str(Path(__file__).resolve().parents[2])  # the source root this package runs from, for the servers it starts
LONG_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")
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
    answers GET /health with 200 once ready: dflash2 bench serve http's llama-server), started and waited for."""

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


def long_prompt(rng: random.Random, words: int) -> str:
    """About ``words`` tokens of filler and a question about it (a long prompt that still gets a short answer)."""
    filler = " ".join(rng.choice(LONG_WORDS) for _ in range(words))
    return f"{filler}\n\nHow many times does the word alpha appear above? Answer with a number."


def good_client(server: Server, model: str, stop_at: float, seed: int, out: dict, lock: threading.Lock,
                long_share: float = 0.0, long_words: int = 1500, cancel_share: float = 0.0) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=server.url, timeout=600) as client:
        while time.monotonic() < stop_at:
            sampled, stream = rng.random() < 0.5, rng.random() < 0.5
            long = rng.random() < long_share
            content = long_prompt(rng, long_words) if long else rng.choice(QUESTIONS)
            body = {"model": model, "messages": [{"role": "user", "content": content}],
                    "max_tokens": rng.randint(16, 64), "temperature": 0.8 if sampled else 0.0, "stream": stream}
            if sampled and rng.random() < 0.5:
                body["seed"] = rng.randint(0, 2**31)
            cancel = stream and rng.random() < cancel_share
            started = time.monotonic()
            try:
                ok, tokens = _cancelled_call(client, body) if cancel else _good_call(client, body, stream)
            except httpx.HTTPError as error:
                ok, tokens = False, 0
                with lock:
                    out["errors"].append(f"{type(error).__name__}: {error}")
            with lock:
                out["cancelled" if cancel and ok else "good_ok" if ok else "good_failed"] += 1
                out["long"] += long and ok
                out["tokens"] += tokens
                if not cancel:
                    out["latencies"].append(time.monotonic() - started)


def _cancelled_call(client: httpx.Client, body: dict) -> tuple[bool, int]:
    """A stream closed by the client after its first two events (the server must drop the request, not fail)."""
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return False, 0
        for events, line in enumerate(response.iter_lines()):
            if events >= 2:
                break
    return True, 0


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--bad-every", type=float, default=2.0, help="seconds between the bad client's requests")
    parser.add_argument("--long-share", type=float, default=0.1, help="share of good requests with a long prompt")
    parser.add_argument("--long-words", type=int, default=1500, help="words (about tokens) of a long prompt")
    parser.add_argument("--cancel-share", type=float, default=0.1,
                        help="share of streamed requests the client closes after their first tokens")
    parser.add_argument("--warmup-seconds", type=float, default=None,
                        help="memory is compared from here (default: 20%% of the run, at most 300)")
    parser.add_argument("--rss-growth-pct", type=float, default=5.0, help="allowed growth after warm-up")
    parser.add_argument("--kill-restart", action="store_true",
                        help="then SIGKILL the server mid-request, start it again on the same store, check it serves")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="extra `dflash2 serve` arguments (after --)")
    args = parser.parse_args(argv)
    warmup = args.warmup_seconds if args.warmup_seconds is not None else min(300.0, 0.2 * args.seconds)

    server = Server(args.model, args.serve_args)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        good, bad, rss, elapsed = run_load(server, model, args)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
        restart = kill_and_restart(server, model, args) if args.kill_restart else None
    finally:
        server.stop()
    report = summary(args, good, bad, rss, elapsed, warmup, health, metrics, restart)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))
    passed = (report["good_failed"] == 0 and report["rss_growth_pct"] <= args.rss_growth_pct and health == 200
              and (restart is None or restart["served"]))
    return 0 if passed else 1


def run_load(server: Server, model: str, args) -> tuple[dict, Counter, list[tuple[float, float]], float]:
    """The clients for ``args.seconds``: (good counts, bad statuses, RSS samples (s, MB), elapsed s)."""
    lock = threading.Lock()
    good = {"good_ok": 0, "good_failed": 0, "cancelled": 0, "long": 0, "tokens": 0, "latencies": [], "errors": []}
    bad: Counter = Counter()
    started = time.monotonic()
    stop_at = started + args.seconds
    threads = [threading.Thread(target=good_client, args=(server, model, stop_at, i, good, lock, args.long_share,
                                                          args.long_words, args.cancel_share))
               for i in range(args.clients)]
    threads.append(threading.Thread(target=bad_client, args=(server, model, stop_at, args.bad_every, bad)))
    for thread in threads:
        thread.start()
    rss = []
    while any(t.is_alive() for t in threads):
        rss.append((round(time.monotonic() - started, 1), round(server.rss_mb(), 1)))
        time.sleep(1.0)
    return good, bad, rss, time.monotonic() - started


def kill_and_restart(server: Server, model: str, args) -> dict:
    """SIGKILL the server while it streams a reply, start it again on the same store and ask it for a reply."""
    body = {"model": model, "messages": [{"role": "user", "content": long_prompt(random.Random(0), 300)}],
            "max_tokens": 256, "temperature": 0.0, "stream": True}
    events = 0
    with httpx.Client(base_url=server.url, timeout=600) as client:
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        server.process.kill()  # SIGKILL: no handler runs, nothing is flushed
        except httpx.HTTPError:
            pass  # the connection dies with the server
    server.process.wait(30)
    started = time.monotonic()
    again = Server(args.model, args.serve_args)
    try:
        ready_s = time.monotonic() - started
        reply = httpx.post(f"{again.url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 16})
        served = reply.status_code == 200 and bool(reply.json()["choices"][0]["message"]["content"])
    finally:
        again.stop()
    verify = subprocess.run([sys.executable, "-m", "dflash2.cli", "models", "verify", args.model], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": SRC}) if "/" not in args.model else None
    leftovers = [str(p) for p in _store_leftovers(args.model)]
    return {"events_before_kill": events, "exit_code": server.process.returncode, "restart_ready_s": round(ready_s, 1),
            "served": served and (verify is None or verify.returncode == 0) and not leftovers,
            "verify": None if verify is None else (verify.returncode, (verify.stdout + verify.stderr).strip()[-300:]),
            "part_files": leftovers}


def _store_leftovers(model: str) -> list[Path]:
    """Temporary files of an interrupted write left beside the model in the store (none may be used or stay)."""
    from dflash2.models.store import canonical_name, home

    name = canonical_name(model)
    if name is None:
        return []
    places = [home() / "gguf", home() / "models" / name]
    return [p for place in places if place.is_dir() for p in place.rglob("*.part")]


def _median_between(rss: list[tuple[float, float]], start: float, end: float) -> float:
    values = [mb for t, mb in rss if start <= t <= end]
    return statistics.median(values) if values else float("nan")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def summary(args, good: dict, bad: Counter, rss, elapsed: float, warmup: float, health: int, metrics: str,
            restart: dict | None) -> dict:
    warm = _median_between(rss, warmup, warmup + 30)
    end = _median_between(rss, rss[-1][0] - 30, rss[-1][0])
    return {
        "model": args.model, "clients": args.clients, "seconds": round(elapsed, 1), "serve_args": args.serve_args,
        "good_ok": good["good_ok"], "good_failed": good["good_failed"], "cancelled": good["cancelled"],
        "long_prompts_served": good["long"], "errors": good["errors"][:20],
        "tokens_per_s": round(good["tokens"] / elapsed, 2),
        "latency_s_p50": _percentile(good["latencies"], 0.5), "latency_s_p99": _percentile(good["latencies"], 0.99),
        "bad": dict(sorted(bad.items())), "health_after": health,
        "warmup_s": warmup, "rss_mb_after_warmup": round(warm, 1), "rss_mb_end": round(end, 1),
        "rss_mb_peak": max(mb for _, mb in rss), "rss_growth_pct": round(100 * (end - warm) / warm, 2),
        "kill_restart": restart, "rss_samples": rss,
        "metrics_tail": [line for line in metrics.splitlines() if "requests_finished" in line],
    }
