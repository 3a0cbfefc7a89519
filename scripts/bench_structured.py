"""Structured output with and without speculation, through the server's batch engine (one request at a time).

For every prompt of data/eval/structured/extraction.jsonl (24 extraction tasks with a JSON schema each), greedy:
the reply under the schema's grammar with plain decoding and with the server's ``auto`` drafter, whose drafts the
grammar shapes (drafters/grammar.py: forced tokens drafted, forbidden ones not, grammar-checked lookups), one
after the other per prompt
(``--unguided``: also ``auto`` with the drafter's own drafts, as before the shaping). Checks that every reply parses
and validates and that the replies are the same tokens; reports tokens/s of each, acceptance by draft position,
and the grammar's cost (the constraint's mask and advance time) per target pass, as a share of a plain pass. Raw
rows to --out.

    nice -n 10 .venv/bin/python scripts/bench_structured.py --out /tmp/structured.jsonl [--threads 1]

On a machine shared with other jobs, ``--threads 1``: OpenMP workers that spin-wait for a busy core make each pass
several times slower (SmolLM2 on 2 cores under a load average of 14, 2026-12-06: ~1 s a pass with 2 threads,
0.08 s with 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
import torch

import dflash2
from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from dflash2.serve.structured import Grammars, RequestConstraint, XgrammarState

DATA = Path(__file__).resolve().parents[1] / "data" / "eval" / "structured" / "extraction.jsonl"


class TimedConstraint(RequestConstraint):
    """The server's constraint, timing its own work (the grammar's part of each pass)."""

    seconds: float = 0.0
    guided: bool = True  # drafts shaped by the grammar (False: the drafter's own, masked only at verification)
    drafter = None  # the request's drafter as the engine wrapped it

    def guide(self, drafter):
        self.drafter = super().guide(drafter) if self.guided else drafter
        return self.drafter

    def constrain(self, draft, logits):
        started = time.perf_counter()
        try:
            return super().constrain(draft, logits)
        finally:
            self.seconds += time.perf_counter() - started

    def advance(self, emitted):
        started = time.perf_counter()
        super().advance(emitted)
        self.seconds += time.perf_counter() - started


def run(batch: BatchEngine, grammars: Grammars, vocab: int, prompt_ids: list[int], schema: dict, drafter: str,
        k: int, max_tokens: int, guided: bool = True) -> dict:
    constraint = TimedConstraint(XgrammarState(grammars.json_schema(schema)), vocab)
    constraint.guided = guided
    request = BatchRequest(prompt_ids, max_tokens, drafter=drafter if k else "none", num_draft_tokens=k,
                           constraint=constraint)
    result = run_to_completion(batch, [request])[0]
    stats = result.stats
    try:
        jsonschema.validate(json.loads(result.text), schema)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        valid = False
    return {"tokens": result.token_ids, "text": result.text, "valid": valid, "finish": result.finish_reason,
            "decode_s": stats.decode_seconds, "forwards": stats.target_forwards, "grammar_s": constraint.seconds,
            "tau": stats.tau, "drafted": stats.drafted_by_position, "accepted": stats.accepted_by_position,
            "forced_drafts": getattr(constraint.drafter, "forced_drafts", 0),
            "cut_drafts": getattr(constraint.drafter, "cut_drafts", 0),
            "looked_up_drafts": getattr(constraint.drafter, "looked_up_drafts", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    parser.add_argument("--out", default="/tmp/structured.jsonl")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--unguided", action="store_true", help="also run auto with unshaped drafts")
    parser.add_argument("--fixed-draft-length", action="store_true",
                        help="always draft the drafter's length (default: the server's planner, which drafts less "
                             "where its measured step costs say drafting does not pay)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = dflash2.load(args.model, drafter="auto", serving=True)
    drafter, k = engine.drafter.name, engine.drafter.num_draft_tokens
    config = BatchConfig(num_blocks=512, block_size=16, adaptive_drafts=not args.fixed_draft_length)
    batch = BatchEngine(engine, config, request_drafters(engine))
    vocab = engine.target.config.vocab_size
    grammars = Grammars(engine.tokenizer.hf, vocab, engine.tokenizer.eos_token_ids)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()][: args.limit or None]
    warm = engine.encode_prompt([{"role": "user", "content": "Hi"}])
    for name, kk in (("none", 0), (drafter, k)):  # kernels, grammar compiler and drafter warmed outside the timing
        run(batch, grammars, vocab, warm, {"type": "object"}, name, kk, 8)
    with open(args.out, "w") as out:
        for row in rows:
            prompt_ids = engine.encode_prompt([{"role": "user", "content": row["prompt"]}])
            plain = run(batch, grammars, vocab, prompt_ids, row["schema"], "none", 0, args.max_tokens)
            auto = run(batch, grammars, vocab, prompt_ids, row["schema"], drafter, k, args.max_tokens)
            record = {"id": row["id"], "drafter": drafter, "k": k, "plain": plain, "auto": auto,
                      "identical": plain["tokens"] == auto["tokens"]}
            if args.unguided:
                record["unguided"] = run(batch, grammars, vocab, prompt_ids, row["schema"], drafter, k,
                                         args.max_tokens, guided=False)
                record["identical"] &= plain["tokens"] == record["unguided"]["tokens"]
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{row['id']:12s} tokens {len(plain['tokens']):3d} valid {plain['valid']}/{auto['valid']} "
                  f"identical {record['identical']} plain {len(plain['tokens']) / plain['decode_s']:.2f} tok/s, "
                  f"auto {len(auto['tokens']) / auto['decode_s']:.2f} tok/s (tau {auto['tau']:.2f}, forced "
                  f"{auto['forced_drafts']})" + (f", unguided {rate(record['unguided']):.2f} tok/s (tau "
                                                   f"{record['unguided']['tau']:.2f})" if args.unguided else ""),
                  flush=True)
    summarize(args.out)


def rate(method: dict) -> float:
    return len(method["tokens"]) / method["decode_s"]


def acceptance(records: list[dict], method: str) -> str:
    """Pooled acceptance by draft position: accepted / drafted at each position."""
    drafted: list[int] = []
    accepted: list[int] = []
    for r in records:
        for position, (d, a) in enumerate(zip(r[method]["drafted"], r[method]["accepted"])):
            if position == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[position] += d
            accepted[position] += a
    return " ".join(f"{100 * a / d:.0f}%" for d, a in zip(drafted, accepted) if d)


def summarize(path: str) -> None:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    plain_tokens = sum(len(r["plain"]["tokens"]) for r in records)
    plain_s = sum(r["plain"]["decode_s"] for r in records)
    auto_tokens = sum(len(r["auto"]["tokens"]) for r in records)
    auto_s = sum(r["auto"]["decode_s"] for r in records)
    forwards = sum(r["plain"]["forwards"] for r in records)
    grammar_s = sum(r["plain"]["grammar_s"] for r in records)
    step = (plain_s - grammar_s) / forwards
    print(f"{len(records)} prompts: valid plain {sum(r['plain']['valid'] for r in records)}, auto "
          f"{sum(r['auto']['valid'] for r in records)}; identical {sum(r['identical'] for r in records)}")
    print(f"plain {plain_tokens / plain_s:.2f} tok/s, auto {auto_tokens / auto_s:.2f} tok/s "
          f"({plain_s / plain_tokens / (auto_s / auto_tokens):.2f}x)")
    for method in ("auto", "unguided"):
        if method in records[0]:
            tokens = sum(len(r[method]["tokens"]) for r in records)
            seconds = sum(r[method]["decode_s"] for r in records)
            forwards = sum(r[method]["forwards"] for r in records)
            print(f"{method}: {tokens / seconds:.2f} tok/s = {plain_s / plain_tokens / (seconds / tokens):.2f}x plain, "
                  f"tau {tokens / forwards:.2f}, forced drafts {sum(r[method]['forced_drafts'] for r in records)}, "
                  f"looked up {sum(r[method].get('looked_up_drafts', 0) for r in records)}, "
                  f"acceptance by position {acceptance(records, method)}")
    print(f"grammar per plain pass {1e3 * grammar_s / forwards:.2f} ms = {100 * grammar_s / forwards / step:.2f}% of "
          f"a plain pass ({1e3 * step:.1f} ms)")


if __name__ == "__main__":
    main()
