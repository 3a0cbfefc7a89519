"""Aggregate serving throughput of the batch engine: S concurrent streams, speculation off / fixed / adaptive.

Each stream is a client thread that submits a request, waits for its result and submits the next (closed
loop), through the same loop thread ``dflash2 serve`` runs (no HTTP in the measurement). Configurations are
interleaved round by round so that machine noise hits them alike. Raw runs go to --out as JSONL.

    .venv/bin/dflash2 bench serve batch --model smollm2-135m-instruct --dtype fp32 --streams 1,8
    .venv/bin/dflash2 bench serve batch --model qwen2.5-coder-1.5b-instruct --dtype bf16 --drafter auto \
        --streams 8 --modes plain,spec --requests 8 --max-tokens 128 --rounds 1

``--drafter`` is what ``dflash2 serve --drafter`` takes (a spec: ``auto``, ``pard+ngram:3``, ``ngram:8``...; ``auto``
means what it means in the server);
mode ``spec`` drafts its default length k, ``adaptive`` lets the scheduler pick up to k per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from collections import defaultdict

import torch

import dflash2
from dflash2.bench.datasets import load_suite
from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters
from dflash2.decode.engine import GenerationResult
from dflash2.drafters.spec import DrafterSpec

MODES = {  # name -> (drafts per step, adaptive scheduler); None = the drafter's own k
    "plain": (0, False),
    "spec": (None, False),
    "adaptive": (None, True),
}


def run_streams(batch: BatchEngine, prompts: list[list[int]], streams: int, drafter: str, num_draft_tokens: int,
                max_tokens: int) -> dict:
    """``streams`` client threads share ``prompts`` (each taken once); returns tokens, seconds, tau."""
    queue = list(prompts)
    lock = threading.Lock()
    results = []

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop(0)
            done = threading.Event()
            events = []

            def sink(event, events=events, done=done) -> None:
                events.append(event)
                if isinstance(event, (GenerationResult, Exception)):
                    done.set()

            name = drafter if num_draft_tokens else "none"
            batch.submit(BatchRequest(prompt, max_tokens, drafter=name, num_draft_tokens=num_draft_tokens), sink)
            if not done.wait(600):
                raise TimeoutError("a request did not finish within 600 s")
            if isinstance(events[-1], Exception):
                raise events[-1]
            with lock:
                results.append(events[-1])

    threads = [threading.Thread(target=client) for _ in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    committed = sum(r.stats.committed_tokens for r in results)
    return {"tokens": tokens, "seconds": seconds, "requests": len(results),
            "tau": committed / forwards if forwards else 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--weights", default="bf16", help="the target's weight format (bf16, int8, gguf...)")
    parser.add_argument("--drafter", default="ngram", help="the server's drafter spec (auto: the target's default)")
    parser.add_argument("--suite", default="humaneval",
                        help="prompts: comma-separated bench suites, interleaved (humaneval, gsm8k, mt_bench...)")
    parser.add_argument("--streams", default="1,8", help="comma-separated concurrent streams")
    parser.add_argument("--modes", default="plain,spec,adaptive", help=f"of {', '.join(MODES)}")
    parser.add_argument("--requests", type=int, default=8, help="requests per run (spread over the streams)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSONL of raw runs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = dflash2.load(args.model, drafter=DrafterSpec.parse(args.drafter), dtype=args.dtype, weights=args.weights,
                          device="cpu", serving=True)  # auto: what `dflash2 serve` drafts
    drafter, k = engine.drafter.name, engine.drafter.num_draft_tokens
    print(f"drafter {args.drafter} = {drafter}, k = {k}", flush=True)
    per_suite = [load_suite(name, limit=args.requests) for name in args.suite.split(",")]
    mixed = [p for group in itertools.zip_longest(*per_suite) for p in group if p is not None][: args.requests]
    prompts = [engine.encode_prompt(p.text) for p in mixed]  # suites interleaved: a mixed load
    streams = [int(s) for s in args.streams.split(",")]
    modes = args.modes.split(",")
    batches = {mode: BatchEngine(engine, BatchConfig(max_batch_size=max(streams), num_blocks=2048,
                                                     adaptive_drafts=MODES[mode][1]), request_drafters(engine))
               for mode in modes}
    for batch in batches.values():
        batch.start()
    warm = batches[modes[0]]
    run_streams(warm, prompts[:1], 1, drafter, 0, 8)  # warm-up, not measured
    totals: dict[tuple[int, str], list[dict]] = defaultdict(list)
    out = open(args.out, "a") if args.out else None
    for round_index in range(args.rounds):
        for s in streams:
            for mode in modes:
                num_draft_tokens = k if MODES[mode][0] is None else MODES[mode][0]
                run = run_streams(batches[mode], prompts, s, drafter, num_draft_tokens, args.max_tokens)
                run.update(round=round_index, streams=s, mode=mode, model=args.model, dtype=args.dtype,
                           weights=args.weights, drafter=drafter, k=num_draft_tokens, suite=args.suite)
                totals[(s, mode)].append(run)
                print(json.dumps(run), flush=True)
                if out:
                    out.write(json.dumps(run) + "\n")
    for batch in batches.values():
        batch.stop()
    base = _rate(totals[(min(streams), "plain")]) if "plain" in modes else None
    print(f"\n{'streams':>7} {'mode':>9} {'tokens/s':>9} {'tau':>5} {'x 1-stream plain':>17}")
    for (s, mode), runs in sorted(totals.items()):
        rate = _rate(runs)
        tau = sum(r["tau"] for r in runs) / len(runs)
        ratio = f"{rate / base:.2f}" if base else "-"
        print(f"{s:>7} {mode:>9} {rate:>9.1f} {tau:>5.2f} {ratio:>17}")
    return 0


def _rate(runs: list[dict]) -> float:
    """Aggregate tokens per second over all rounds (ratio of sums)."""
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)
