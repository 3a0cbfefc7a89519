"""Raw rows and summary columns for peer runners (other tools) in ``dflash2 bench``; pure, no peer imported."""

from __future__ import annotations

from statistics import mean

from dflash2.bench.datasets import BenchPrompt


def peer_row(prompt: BenchPrompt, peer, result, baseline_ids: list[int] | None,
             own_plain_ids: list[int] | None) -> dict:
    """One JSON line for a peer's request, with the same keys as dflash2's rows plus the peer's own comparisons."""
    return {
        "suite": prompt.suite, "category": prompt.category, "prompt_id": prompt.prompt_id, "method": peer.name,
        "peer": True, "plain_sibling": peer.plain_sibling,
        "prompt_tokens": result.prompt_tokens, "new_tokens": result.new_tokens,
        "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
        "tokens_per_s": result.tokens_per_s, "decode_tokens_per_s": result.decode_tokens_per_s,
        "tau": result.tau, "target_forwards": result.target_forwards,
        "acceptance_by_position": [], "drafted_by_position": [], "accepted_by_position": [],
        "drafted": result.drafted, "accepted": result.accepted,
        "draft_seconds": None, "verify_seconds": None, "finish_reason": result.finish_reason,
        "matches_baseline": None if baseline_ids is None else result.token_ids == baseline_ids,
        "matches_own_plain": None if own_plain_ids is None else result.token_ids == own_plain_ids,
        "token_ids": result.token_ids, **({"extra": result.extra} if result.extra else {}),
    }


def own_plain_columns(group: list[dict], rows: list[dict]) -> dict:
    """Speedup of a peer over its own plain decoding on the same prompts, and how often its output equals it."""
    sibling = group[0].get("plain_sibling")
    if not sibling:
        return {"plain_sibling": None, "speedup_vs_own_plain": None, "identical_to_own_plain": None}
    plain = {(r["category"], r["prompt_id"]): r["decode_tokens_per_s"] for r in rows if r["method"] == sibling}
    paired = [r for r in group if (r["category"], r["prompt_id"]) in plain]
    matches = [r["matches_own_plain"] for r in group if r.get("matches_own_plain") is not None]
    speedup = None
    if paired:
        base = mean(plain[(r["category"], r["prompt_id"])] for r in paired)
        speedup = mean(r["decode_tokens_per_s"] for r in paired) / base if base else None
    return {"plain_sibling": sibling, "speedup_vs_own_plain": speedup,
            "identical_to_own_plain": sum(matches) / len(matches) if matches else None}
