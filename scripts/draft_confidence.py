"""Does the PARD drafter's own confidence say how far its block will be accepted? Replays of greedy decoding.

Greedy speculative output equals plain greedy output, so one plain run per prompt fixes the text; the drafter's
block at every position of it (the ids up to there, K drafts from one pass) does not depend on where the steps
fell. With the blocks, their top-1 probabilities and this machine's measured pass times, any draft-length policy
replays exactly: a step at position t with k drafts accepts min(k, leading matches) and costs the draft pass (the
ids it had not read + k - 1 masks) plus a verification of k + 1 rows.

Policies replayed (all lossless; they only choose k): fixed k; the engine's adaptive policy (the
``AdaptiveDraftLength`` class fed the replayed times); and confidence policies, which draft K per pass and keep the
k that maximises expected tokens per second, reading draft i's acceptance from its top-1 probability p_i
(``raw``: p_i itself; ``binned``: acceptance counted per probability bin as the request goes on).

    nice -n 5 .venv/bin/python scripts/draft_confidence.py --weights gguf --suite gsm8k,mt_bench --limit 4 \
        --out runs/draft-confidence
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from pathlib import Path

import torch


def timed_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def pass_costs(engine, pard, max_rows: int, context: int, repeats: int) -> tuple[list[float], list[float]]:
    """ms of a draft pass over r rows (index r) and of a target verification of r rows, after ``context`` ids."""
    target = engine.target
    ids = list(range(1000, 1000 + context))
    cache = target.new_cache(context + max_rows + 2)
    target(torch.tensor([ids]), cache=cache, logits="last")
    start = cache.length

    def verify(rows: int) -> None:
        cache.rollback(start)
        target(torch.tensor([ids[:rows]]), cache=cache, logits="all")

    drafter = pard.for_request()
    drafter.reset(context + 64)
    drafter.prefill(ids)

    def draft(rows: int) -> None:  # one pending id + rows - 1 masks, then back to the prompt
        drafter.draft_logits(ids + [7], rows)
        drafter._sync(ids + [7])

    verify_ms = [0.0] + [timed_ms(lambda r=r: verify(r), repeats) for r in range(1, max_rows + 1)]
    draft_ms = [0.0] + [timed_ms(lambda r=r: draft(r), repeats) for r in range(1, max_rows + 1)]
    cache.rollback(start)
    return draft_ms, verify_ms


@torch.inference_mode()
def record_prompt(engine, pard, hybrid, text: str, tokens: int, block: int, candidates: int = 4) -> dict:
    """The greedy output and, at each of its positions, the drafter's block, top-1 probabilities and lookup."""
    result = engine.generate(text, max_new_tokens=tokens)
    prompt = engine.encode_prompt(text)
    out = list(result.token_ids)
    drafter = pard.for_request()
    drafter.reset(len(prompt) + len(out) + block + 8)
    drafter.prefill(prompt)
    head = drafter.model.lm_head
    steps = []
    for t in range(len(out) - 1):
        sequence = prompt + out[: t + 1]
        part = drafter._head_part(drafter._pass_hidden(sequence, block))  # [K, V']
        probs = torch.softmax(part.float(), dim=-1)
        top_p, top_row = probs.topk(candidates, dim=-1)  # [K, C]
        ids = head.ids[top_row] if hasattr(head, "ids") else top_row
        lookup = hybrid._lookup(sequence, hybrid.num_draft_tokens) if hybrid is not None else []
        steps.append({"drafts": ids[:, 0].tolist(), "p": [round(float(p), 5) for p in top_p[:, 0]],
                      "top_ids": ids.tolist(), "top_p": [[round(float(p), 5) for p in row] for row in top_p],
                      "lookup": list(lookup)})
    return {"prompt_len": len(prompt), "output": out, "positions": steps}


def matches(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


class Binned:
    """Acceptance of a draft given that the ones before it were accepted, counted per bin of its top-1
    probability; starts from p itself (prior weight 2)."""

    def __init__(self, bins: int = 10, prior_weight: float = 2.0) -> None:
        self.bins = bins
        self.hits = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.seen = [prior_weight] * bins

    def bin(self, p: float) -> int:
        return min(int(p * self.bins), self.bins - 1)

    def __call__(self, p: float) -> float:
        b = self.bin(p)
        return self.hits[b] / self.seen[b]

    def update(self, ps: list[float], k: int, accepted: int) -> None:
        for i in range(min(k, accepted + 1)):  # drafts 1..accepted hit, draft accepted + 1 (if drafted) missed
            b = self.bin(ps[i])
            self.seen[b] += 1
            self.hits[b] += 1 if i < accepted else 0


def replay(record: dict, policy: str, draft_ms: list[float], verify_ms: list[float], block: int,
           k_fixed: int = 0) -> tuple[int, float, list[int]]:
    """(tokens, ms, chosen k per step) of one request replayed under ``policy``: ``fixed`` (k_fixed drafts),
    ``adaptive`` (the engine's policy, k_max = k_fixed or block), ``raw`` / ``binned`` (a pass of k_fixed drafts,
    trimmed by confidence), ``adaptive+trim`` (the adaptive k as the pass size, trimmed) and ``gated`` (a pass of
    k_fixed where the adaptive policy would draft at all, trimmed)."""
    from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength

    out, positions = record["output"], record["positions"]
    k_max = k_fixed or block
    adaptive = None
    if policy in ("adaptive", "adaptive+trim", "gated"):
        adaptive = AdaptiveDraftLength(AdaptiveConfig(k_max=k_max, per_pass=True))
    binned = Binned() if policy != "raw" else None
    t, unread, total_ms, ks = 0, 1, 0.0, []

    def pass_ms(k: int) -> float:
        return draft_ms[min(unread + k - 1, len(draft_ms) - 1)] if k else 0.0

    while t < len(positions):
        step = positions[t]
        truth = out[t + 1 :]
        lookup = step["lookup"]
        if lookup:
            k, accepted, d_ms = len(lookup), matches(lookup, truth), 0.0
        else:
            if policy == "fixed":
                size = k_fixed
            elif policy in ("raw", "binned"):
                size = k_fixed
            else:
                size = adaptive.next_length(block)
                if policy == "gated" and size:
                    size = k_fixed
            d_ms = pass_ms(size)
            k = size
            if size and policy not in ("fixed", "adaptive"):
                calibrate = binned if binned is not None else (lambda p: p)
                k = best_k(step["p"][:size], calibrate, d_ms, verify_ms)
            accepted = matches(step["drafts"][:k], truth)
        accepted = min(accepted, k, len(positions) - t)
        v_ms = verify_ms[k + 1]
        if not lookup:
            if adaptive is not None:
                adaptive.record(k, accepted, d_ms / 1e3, v_ms / 1e3)
            if binned is not None:
                binned.update(step["p"], k, accepted)
        total_ms += d_ms + v_ms
        ks.append(k)
        unread = accepted + 1 if (d_ms and not lookup) else unread + accepted + 1
        t += accepted + 1
    return t, total_ms, ks


def best_k(ps: list[float], calibrate, pass_ms: float, verify_ms: list[float]) -> int:
    """argmax over k >= 1 of (1 + sum of reach) / (pass + verification of k + 1 rows), as
    ``AdaptiveDraftLength.trim`` chooses (the pass has run: it gave the probabilities)."""
    best, best_rate, reach, expected = 0, 0.0, 1.0, 1.0
    for k in range(1, len(ps) + 1):
        reach *= calibrate(ps[k - 1])
        expected += reach
        rate = expected / (pass_ms + verify_ms[k + 1])
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def best_first(top_ids: list[list[int]], top_p: list[list[float]], max_nodes: int, width: int) -> list[tuple]:
    """Up to ``max_nodes`` nodes (depth, token, reach, parent) in order of reach: a node at depth d has as children
    position d + 1's top ``width`` candidates, its reach the product of the probabilities along its path."""
    nodes: list[tuple] = []
    frontier = [(-top_p[0][j], j, 0, j, -1) for j in range(width)]
    heapq.heapify(frontier)
    tie = width
    while frontier and len(nodes) < max_nodes:
        neg_reach, _, depth, j, parent = heapq.heappop(frontier)
        nodes.append((depth, top_ids[depth][j], -neg_reach, parent))
        if depth + 1 < len(top_ids):
            for child in range(width):
                tie += 1
                heapq.heappush(frontier, (neg_reach * top_p[depth + 1][child], tie, depth + 1, child, len(nodes) - 1))
    return nodes


def accepted_depth(nodes: list[tuple], truth: list[int]) -> int:
    """How deep greedy verification of the tree ``nodes`` accepts against the true continuation."""
    current, depth = -1, 0
    while depth < len(truth):
        child = next((i for i, node in enumerate(nodes) if node[3] == current and node[1] == truth[depth]), None)
        if child is None:
            break
        current, depth = child, depth + 1
    return depth


def replay_tree(record: dict, draft_ms: list[float], verify_ms: list[float], block: int, max_nodes: int,
                width: int) -> tuple[int, float, int]:
    """(tokens, ms, steps) with a pass of ``block`` positions and the best-first tree through each position's top
    ``width`` candidates, sized like a trimmed chain (n >= 1 nodes for the most expected tokens per ms; a tree of n
    nodes priced as a chain of n, as the fused gguf layer verifies both)."""
    out, positions = record["output"], record["positions"]
    t, unread, total_ms, steps = 0, 1, 0.0, 0
    while t < len(positions):
        step, truth = positions[t], out[t + 1 :]
        if step["lookup"]:
            k, accepted, d_ms = len(step["lookup"]), matches(step["lookup"], truth), 0.0
        else:
            d_ms = draft_ms[min(unread + block - 1, len(draft_ms) - 1)]
            nodes = best_first(step["top_ids"][:block], step["top_p"][:block], max_nodes, width)
            k, best_rate, expected = 0, 0.0, 1.0
            for n in range(1, len(nodes) + 1):
                expected += nodes[n - 1][2]
                if expected / (d_ms + verify_ms[n + 1]) > best_rate:
                    k, best_rate = n, expected / (d_ms + verify_ms[n + 1])
            accepted = accepted_depth(nodes[:k], truth)
        accepted = min(accepted, len(positions) - t)
        total_ms += d_ms + verify_ms[k + 1]
        steps += 1
        unread = accepted + 1 if d_ms else unread + accepted + 1
        t += accepted + 1
    return t, total_ms, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="gguf")
    parser.add_argument("--suite", default="gsm8k,mt_bench")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block", type=int, default=8, help="drafts per recorded pass (the longest k replayed)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import dflash2
    from dflash2.bench.datasets import load_suites
    from dflash2.drafters.hybrid import HybridDrafter

    args.out.mkdir(parents=True, exist_ok=True)
    engine = dflash2.load(weights=args.weights, drafter="auto", adaptive_draft=False)
    hybrid = engine.drafter if isinstance(engine.drafter, HybridDrafter) else None
    pard = hybrid.block if hybrid is not None else engine.drafter
    engine.drafter = None  # plain decoding fixes the text (speculative greedy output is the same)
    draft_ms, verify_ms = pass_costs(engine, pard, args.block + 9, args.context, args.repeats)
    print("draft pass ms by rows:", [round(x, 2) for x in draft_ms[1:]])
    print("verify ms by rows:   ", [round(x, 2) for x in verify_ms[1:]])
    records = []
    for prompt in load_suites(args.suite.split(","), args.limit):
        record = record_prompt(engine, pard, hybrid, prompt.text, args.max_new_tokens, args.block)
        record.update(suite=prompt.suite, prompt_id=prompt.prompt_id)
        records.append(record)
        print(prompt.suite, prompt.prompt_id, len(record["output"]), flush=True)
    (args.out / "records.json").write_text(json.dumps({"draft_ms": draft_ms, "verify_ms": verify_ms,
                                                        "records": records}))
    report(records, draft_ms, verify_ms, args.block)


def report(records, draft_ms, verify_ms, block) -> None:
    policies = ([("fixed", k) for k in range(1, min(block, 4) + 1)] + [("adaptive", k) for k in (3, 4)]
                + [(name, k) for name in ("adaptive+trim", "binned") for k in (3, 4)])
    trees = [(4, nodes, width) for nodes in (6, 12) for width in (2, 3)]
    for suite in sorted({r["suite"] for r in records}):
        print(f"\n{suite}: policy, tokens/s (replayed), tokens per step")
        chosen = [r for r in records if r["suite"] == suite]
        for policy, k in policies:
            tokens = ms = steps = 0
            for r in chosen:
                n, t, ks = replay(r, policy, draft_ms, verify_ms, block, k)
                tokens, ms, steps = tokens + n, ms + t, steps + len(ks)
            print(f"  {policy + ':' + str(k):18s} {1e3 * tokens / ms:7.2f}  {tokens / steps:5.2f}")
        if "top_ids" not in chosen[0]["positions"][0]:
            continue
        for size, nodes, width in trees:
            tokens = ms = steps = 0
            for r in chosen:
                n, t, s = replay_tree(r, draft_ms, verify_ms, size, nodes, width)
                tokens, ms, steps = tokens + n, ms + t, steps + s
            print(f"  {f'tree {size}x{width} <= {nodes}':18s} {1e3 * tokens / ms:7.2f}  {tokens / steps:5.2f}")


if __name__ == "__main__":
    main()
