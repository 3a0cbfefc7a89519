"""Time to first token of a chat's second turn (prefix cache) against a cold request of the same length, through
the official `openai` client against a `dflash2 serve` this script starts (streaming, greedy).

    .venv/bin/dflash2 bench serve ttft --rounds 3 --out runs/ttft-prefix.json
    .venv/bin/dflash2 bench serve ttft --serve-args "--no-prefix-cache" --rounds 2

Each round: turn 1 is a new conversation of about --prompt-tokens tokens (a unique first line, so nothing but the
chat template's system lines can be cached); turn 2 is turn 1 + its answer + a follow-up question (its prefix is
cached); then the same turn-2 messages with another unique first line, a cold request of the same length. The
report gives, per request, the time to the first streamed content, the prompt tokens and the cached ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2]  # the source root this package runs from
FOLLOW_UP = "Thanks. Now list the three most important functions in that file, one line each."


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "DFLASH2_API_KEY": "ttft"}
    command = [sys.executable, "-m", "dflash2.cli", "serve", "--model", args.model, "--port", str(args.port),
               *shlex.split(args.serve_args)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.terminate()
    raise SystemExit("the server did not start in time")


def document(tokens: int) -> str:
    """About ``tokens`` tokens of source code to talk about (this repository's batch engine; Qwen2.5's tokenizer
    reads it at about 4.3 characters a token)."""
    text = (SRC / "dflash2/decode/batch.py").read_text()
    return text[: int(tokens * 4.3)]


def first_turn(tokens: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{_tag()} Read this file and summarize it in one sentence.\n\n"
                                        f"{document(tokens)}"}]


def _tag() -> str:
    """A unique first line: a request starting with it shares no cached block past the chat template's head."""
    return f"[session {uuid.uuid4().hex[:12]}]"


def retagged(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same messages under a new session tag (as long, nothing of it cached)."""
    head, rest = messages[0]["content"].split("] ", 1)
    return [{"role": "user", "content": f"{_tag()} {rest}"}, *messages[1:]]


def ask(client, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    """Stream one greedy reply; the seconds to its first content, its text and usage."""
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            first = first or time.perf_counter() - started
            parts.append(text)
    total = time.perf_counter() - started
    details = usage.prompt_tokens_details
    return {"ttft_s": round(first or total, 3), "total_s": round(total, 3), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": 0 if details is None else details.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "decode_tokens_per_s": round((usage.completion_tokens - 1) / (total - first), 2) if first else 0.0,
            "text": "".join(parts)}


def run_round(client, args: argparse.Namespace) -> dict:
    turn_1 = first_turn(args.prompt_tokens)
    one = ask(client, args.model, turn_1, args.max_tokens)
    turn_2 = [*turn_1, {"role": "assistant", "content": one.pop("text")}, {"role": "user", "content": FOLLOW_UP}]
    two = ask(client, args.model, turn_2, args.max_tokens)
    cold = ask(client, args.model, retagged(turn_2), args.max_tokens)
    two.pop("text"), cold.pop("text")  # different session tags: the replies may differ (exactness: the tests)
    return {"turn_1": one, "turn_2": two, "cold_same_length": cold,
            "ttft_ratio": round(two["ttft_s"] / cold["ttft_s"], 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--serve-args", default="", help="extra `dflash2 serve` arguments (one string)")
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1900, help="about this many tokens in turn 1")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import openai

    process, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="ttft", max_retries=0, timeout=600)
        ask(client, args.model, [{"role": "user", "content": "Say hi."}], 4)  # warm-up (kernels, allocator)
        rounds = []
        for _ in range(args.rounds):
            rounds.append(run_round(client, args))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)  # progress on a slow machine
    finally:
        process.terminate()
        process.wait(30)
    report = {"model": args.model, "serve_args": args.serve_args, "rounds": rounds,
              "median_ttft_ratio": statistics.median(r["ttft_ratio"] for r in rounds)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0
