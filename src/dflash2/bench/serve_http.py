"""Serving throughput over real HTTP: `dflash2 serve` (its default drafter, and plain decoding on the same server)
against llama.cpp's `llama-server` on the same GGUF file, C closed-loop clients each.

Every configuration gets the same requests (the first --requests prompts of the eval suites, greedy, --max-tokens
new tokens at most), sent by C client threads that each post a request, wait for the reply and post the next; the
client counts and configurations are interleaved round by round, so that a shared machine's drift hits them alike.
The servers run side by side (an idle one costs no CPU): `dflash2 serve --model MODEL --weights W` and, with
`llamacpp` in --configs, `llama-server -m <the store's GGUF> -np <most clients>` (built by `WITH_SERVER=1
scripts/build_llama_cpp.sh`). Configurations: `dflash2` (the server's own drafter, `auto`), `dflash2-plain` (the
same server, each request with `{"dflash2": {"drafter": "none"}}`), `dflash2@SPEC` (a server of its own started with
`--drafter SPEC`, e.g. `dflash2@pard+ngram`), `llamacpp` (plain), `llamacpp@TYPE` (llama-server's own speculative
decoding, `--spec-type TYPE`: `llamacpp@draft-simple` drafts with --draft-model's GGUF, by default the store's 0.5B for
the default target; `llamacpp@ngram-mod` and the other n-gram types need no model; --llama-draft-max sets
`--spec-draft-n-max`, else llama.cpp's default).

    .venv/bin/dflash2 bench serve http --model qwen2.5-coder-1.5b-instruct --weights gguf --clients 1,4 \\
        --requests 8 --max-tokens 128 --configs dflash2-plain,dflash2,llamacpp --out runs/http

Reports per configuration and client count: requests, generated tokens, wall seconds, tokens/s over all clients,
median latency, and tokens/s over the first configuration's at the same client count. Raw per-request rows go to
--out/requests.jsonl, the table to --out/summary.md.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from dflash2.bench.datasets import load_suites
from dflash2.bench.serve_load import Server  # the servers' start and stop, shared with the load test
from dflash2.models import store

CONFIGS = ("dflash2", "dflash2-plain", "llamacpp")


@dataclass
class RequestRow:
    config: str
    clients: int
    round: int
    prompt_id: str
    ok: bool
    completion_tokens: int
    latency_s: float
    error: str = ""
    drafted: int | None = None  # llama-server's speculative decoding: draft tokens proposed / accepted (its timings)
    accepted: int | None = None
    target_forwards: int | None = None  # dflash2's own count (its "dflash2" field); llama-server: tokens - accepted


def llama_command(model: str, slots: int, context: int, spec_type: str | None = None, draft_model: str | None = None,
                  draft_max: int | None = None) -> Callable[[int], list[str]]:
    """llama-server's command line for a port: the store's GGUF of `model`, `slots` parallel sequences of `context`
    tokens each, as many threads as dflash2 uses; with `spec_type` its speculative decoding of that type (`draft-*`
    types draft with `draft_model`'s GGUF)."""
    from dflash2.peers.llamacpp import llama_cpp_bin_dir

    binary = llama_cpp_bin_dir() / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"llamacpp: {binary} is missing: build it with WITH_SERVER=1 scripts/build_llama_cpp.sh")
    drafting = bool(spec_type and spec_type.startswith("draft"))
    if drafting and draft_model is None:
        raise SystemExit(f"llamacpp@{spec_type}: pass --draft-model (no default draft model for {model!r})")
    target = store_gguf(model, "--model")
    draft = store_gguf(draft_model, "--draft-model") if drafting else None
    threads = torch.get_num_threads()
    return lambda port: llama_argv(binary, target, port, slots, context, threads, spec_type, draft, draft_max)


def store_gguf(model: str | None, flag: str) -> Path:
    """The GGUF file of a model-store name (pulled where it is missing)."""
    name = store.canonical_name(model) if model else None
    if name is None:
        raise SystemExit(f"llamacpp: {flag} must be a model-store name (its GGUF feeds llama-server), got {model!r}")
    store.resolve_model(name)
    return store.gguf_path(name)


def llama_argv(binary: Path, target: Path, port: int, slots: int, context: int, threads: int,
               spec_type: str | None = None, draft: Path | None = None, draft_max: int | None = None) -> list[str]:
    argv = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * context), "-t", str(threads), "-tb", str(threads)]
    if spec_type:
        argv += ["--spec-type", spec_type]
        if draft is not None:
            argv += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        if draft_max is not None:
            argv += ["--spec-draft-n-max", str(draft_max)]
    return argv


def request_body(config: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    if config == "dflash2-plain":
        body["dflash2"] = {"drafter": "none"}
    return body


def target_forwards(reply: dict, tokens: int) -> int | None:
    """The target passes a reply took: dflash2's own count, else llama-server's tokens less its accepted drafts
    (each pass yields its accepted drafts and one token of its own; plain decoding: one pass per token)."""
    if "dflash2" in reply:
        return reply["dflash2"].get("target_forwards")
    if "timings" in reply:
        return tokens - (reply["timings"].get("draft_n_accepted") or 0)
    return None


def run_clients(url: str, config: str, prompts: list[tuple[str, str]], clients: int, max_tokens: int,
                round_index: int) -> tuple[list[RequestRow], float]:
    """Closed loop: `clients` threads take the prompts from one queue until it is empty; (rows, wall seconds)."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]  # (the name the server answers to)
    todo: queue.Queue = queue.Queue()
    for item in prompts:
        todo.put(item)
    rows: list[RequestRow] = []
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=1800) as http:
            while True:
                try:
                    prompt_id, text = todo.get_nowait()
                except queue.Empty:
                    return
                started = time.perf_counter()
                try:
                    response = http.post("/v1/chat/completions", json=request_body(config, model, text, max_tokens))
                    reply = response.json()
                    ok = response.status_code == 200 and "choices" in reply
                    tokens = reply.get("usage", {}).get("completion_tokens", 0) if ok else 0
                    error = "" if ok else f"{response.status_code}: {str(reply)[:200]}"
                    timings = reply.get("timings", {}) if ok else {}
                    forwards = target_forwards(reply, tokens) if ok else None
                except (httpx.HTTPError, ValueError) as exc:
                    ok, tokens, error, timings, forwards = False, 0, f"{type(exc).__name__}: {exc}", {}, None
                row = RequestRow(config, clients, round_index, prompt_id, ok, tokens,
                                 round(time.perf_counter() - started, 3), error, timings.get("draft_n"),
                                 timings.get("draft_n_accepted"), forwards)
                with lock:
                    rows.append(row)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()  # (a client's own error, not a failed request, ends the run)
    return rows, time.perf_counter() - started


def summarize(rows: list[dict], walls: dict[tuple[str, int], float], configs: list[str]) -> list[dict]:
    """One line per (configuration, client count): totals over rounds, tokens/s against the first configuration."""
    lines = []
    for clients in sorted({r["clients"] for r in rows}):
        base = None
        for config in configs:
            mine = [r for r in rows if r["config"] == config and r["clients"] == clients]
            if not mine:
                continue
            tokens = sum(r["completion_tokens"] for r in mine)
            wall = walls[(config, clients)]
            rate = tokens / wall if wall > 0 else 0.0
            base = rate if base is None else base
            lines.append({"config": config, "clients": clients, "requests": len(mine),
                          "failed": sum(not r["ok"] for r in mine), "tokens": tokens, "wall_s": round(wall, 2),
                          "tokens_per_s": round(rate, 2), "vs_first": round(rate / base, 3) if base else None,
                          "latency_s_median": round(statistics.median(r["latency_s"] for r in mine), 2),
                          "draft_accepted": acceptance(mine), "tau": tau(mine)})
    return lines


def acceptance(rows: list[dict]) -> float | None:
    """Accepted over drafted tokens where the server reports them (llama-server), else None."""
    drafted = sum(r.get("drafted") or 0 for r in rows)
    return round(sum(r.get("accepted") or 0 for r in rows) / drafted, 3) if drafted else None


def tau(rows: list[dict]) -> float | None:
    """Tokens per target pass over the rows whose passes are known, else None."""
    known = [r for r in rows if r.get("target_forwards")]
    if not known:
        return None
    return round(sum(r["completion_tokens"] for r in known) / sum(r["target_forwards"] for r in known), 2)


def table(lines: list[dict]) -> str:
    header = ("| config | clients | requests (failed) | tokens | wall s | tokens/s | vs first | median latency s | "
              "tau | draft accepted |")
    out = [header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in lines:
        tau_, accepted = ("-" if x[key] is None else x[key] for key in ("tau", "draft_accepted"))
        out.append(f"| {x['config']} | {x['clients']} | {x['requests']} ({x['failed']}) | {x['tokens']} | "
                   f"{x['wall_s']} | {x['tokens_per_s']} | {x['vs_first']}x | {x['latency_s_median']} | {tau_} | "
                   f"{accepted} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--weights", default="gguf", help="dflash2's weights (gguf: the same file llama-server reads)")
    ap.add_argument("--configs", default="dflash2-plain,dflash2,llamacpp",
                    help=f"from {', '.join(CONFIGS)}, dflash2@SPEC, llamacpp@TYPE; ratios are against the first")
    ap.add_argument("--clients", default="1,4", help="client counts, comma-separated")
    ap.add_argument("--requests", type=int, default=8, help="requests per configuration, client count and round")
    ap.add_argument("--suites", default="humaneval,gsm8k,mt_bench")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048, help="llama-server's tokens per parallel slot")
    ap.add_argument("--draft-model", default=None,
                    help="llamacpp@draft-*: the draft model (default: the store's 0.5B for the default target)")
    ap.add_argument("--llama-draft-max", type=int, default=None, help="llamacpp@TYPE: --spec-draft-n-max")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("serve_args", nargs="*", help="extra `dflash2 serve` arguments (after --)")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS and not c.startswith(("dflash2@", "llamacpp@"))]
    clients = [int(c) for c in args.clients.split(",")]
    if unknown or not configs:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}, dflash2@SPEC, llamacpp@TYPE")
    if min(clients) <= 0 or args.requests <= 0 or args.rounds <= 0 or args.max_tokens <= 0:
        ap.error("--clients, --requests, --rounds and --max-tokens must be positive")
    suites = load_suites(args.suites.split(","))
    prompts = [(f"{p.suite}/{p.prompt_id}", p.text) for p in suites][:args.requests]
    out = args.out or Path("runs") / time.strftime("http-%Y%m%d-%H%M%S")

    servers: dict[str, Server] = {}
    try:
        if "dflash2" in configs or "dflash2-plain" in configs:
            dflash2 = Server(args.model, ["--weights", args.weights, *args.serve_args])
            servers.update({c: dflash2 for c in ("dflash2", "dflash2-plain") if c in configs})
        for config in (c for c in configs if c.startswith("dflash2@")):  # a server per drafter spec
            spec = config.split("@", 1)[1]
            servers[config] = Server(args.model, ["--weights", args.weights, "--drafter", spec, *args.serve_args])
        if "llamacpp" in configs:
            servers["llamacpp"] = Server(args.model, [], llama_command(args.model, max(clients), args.context))
        for config in (c for c in configs if c.startswith("llamacpp@")):  # a llama-server per speculative type
            command = llama_command(args.model, max(clients), args.context, config.split("@", 1)[1],
                                    args.draft_model or store.default_draft(args.model), args.llama_draft_max)
            servers[config] = Server(args.model, [], command)
        rows: list[dict] = []
        walls: dict[tuple[str, int], float] = {}
        for config in configs:  # a warm-up request each (kernel builds, first-touch of the weights)
            run_clients(servers[config].url, config, prompts[:1], 1, 8, -1)
        for round_index in range(args.rounds):
            for n in clients:
                for config in configs:
                    got, wall = run_clients(servers[config].url, config, prompts, n, args.max_tokens, round_index)
                    rows += [asdict(r) for r in got]
                    walls[(config, n)] = walls.get((config, n), 0.0) + wall
                    done = sum(r.completion_tokens for r in got)
                    print(f"round {round_index + 1}/{args.rounds} clients {n} {config}: {done} tokens in {wall:.1f} s "
                          f"({done / wall:.2f} tok/s)", flush=True)
    finally:
        for server in {id(s): s for s in servers.values()}.values():
            server.stop()
    lines = summarize(rows, walls, configs)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    header = (f"model={args.model} weights={args.weights} requests={args.requests} max_tokens={args.max_tokens} "
              f"rounds={args.rounds} (greedy; tokens/s over all clients; configurations interleaved)")
    (out / "summary.md").write_text(header + "\n\n" + table(lines) + "\n")
    print(f"\n{header}\n\n{table(lines)}\n\nrows: {out / 'requests.jsonl'}")
    return 0 if all(line["failed"] == 0 for line in lines) else 1
