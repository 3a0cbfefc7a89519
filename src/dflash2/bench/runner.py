"""``dflash2 bench``: every method on the same prompts, interleaved in one run; raw JSONL first, summary from it."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import torch
from tqdm import tqdm

from dflash2.bench.datasets import BenchPrompt
from dflash2.bench.peer_rows import own_plain_columns, peer_row
from dflash2.drafters.spec import DrafterSpec
from dflash2.models.loading import weight_format
from dflash2.platform import cpu

BASELINE = "none"


@dataclass(frozen=True)
class BenchConfig:
    suites: tuple[str, ...]
    methods: tuple[str, ...]  # drafter names; "none" (plain decoding, the baseline) is always run
    limit: int | None
    max_new_tokens: int
    out_dir: Path
    temperature: float = 0.0
    seed: int = 0


def run_bench(engine, drafters: dict, prompts: list[BenchPrompt], config: BenchConfig, peers: list | None = None,
              run_extra: dict | None = None) -> Path:
    """Run each prompt through every method (baseline first), then every peer (other tools, see dflash2.peers),
    append one JSON line per request."""
    peers = peers or []
    config.out_dir.mkdir(parents=True, exist_ok=True)
    raw_path = config.out_dir / "requests.jsonl"
    info = _run_info(engine, config) | {"peers": [peer.name for peer in peers]} | (run_extra or {})
    (config.out_dir / "run.json").write_text(json.dumps(info, indent=2))
    engine.prefix_cache = False  # every request is measured cold: the same prompt runs once per method
    _warm_up(engine, drafters)
    _warm_up_peers(engine, peers)
    total = len(prompts) * (len(drafters) + len(peers))
    with raw_path.open("w") as raw, tqdm(total=total, desc="bench", unit="req") as bar:
        for prompt in prompts:
            baseline_ids = None
            for method, drafter in drafters.items():
                engine.drafter = drafter
                engine.pipeline = method_pipeline(method)
                result = engine.generate(prompt.text, max_new_tokens=config.max_new_tokens,
                                         temperature=config.temperature, seed=config.seed)
                if method == BASELINE:
                    baseline_ids = result.token_ids
                row = _request_row(prompt, method, result, baseline_ids)
                raw.write(json.dumps(row) + "\n")
                raw.flush()
                bar.set_postfix(method=method, tps=f"{row['decode_tokens_per_s']:.1f}", tau=f"{row['tau']:.2f}")
                bar.update()
            _run_peers(engine, peers, prompt, config, baseline_ids, raw, bar)
    engine.drafter = None
    return raw_path


def method_name(drafter: str, pipeline: str) -> str:
    """A bench method: the drafter, with ``@overlap`` when it runs in the overlapped pipeline."""
    return drafter if pipeline == "sync" or drafter == BASELINE else f"{drafter}@{pipeline}"


def method_pipeline(method: str) -> str:
    return method.partition("@")[2] or "sync"


METHOD_LABELS = {BASELINE: "dflash2 plain", "ngram": "dflash2 ngram", "model": "dflash2 model (0.5B)",
                 "dflash": "dflash2 DFlash", "dflash+ngram": "dflash2 DFlash + ngram", "dflash2": "dflash2 DFlash2",
                 "dflash2+ngram": "dflash2 DFlash2 + ngram", "pard": "dflash2 PARD (0.5B)",
                 "pard+ngram": "dflash2 PARD + ngram", "transformers": "transformers generate",
                 "transformers-assisted": "transformers assisted (0.5B)",
                 "transformers-pld": "transformers prompt lookup", "llamacpp": "llama.cpp 4-bit",
                 "llamacpp-spec": "llama.cpp 4-bit speculative (0.5B)"}


def label(method: str) -> str:
    """A reader's name for a bench method: ``dflash2:3x3@overlap`` -> ``dflash2 DFlash2 k=3 tree x3, overlap``."""
    drafter, _, pipeline = method.partition("@")
    try:
        spec = DrafterSpec.parse(drafter)
    except ValueError:  # a peer (transformers, llama.cpp, ...): a name only
        spec = None
    name = drafter if spec is None else spec.name
    text = METHOD_LABELS.get(name, name)
    if spec is not None:
        text += f" k={spec.num_draft_tokens}" if spec.num_draft_tokens else ""
        text += f" tree x{spec.num_candidates}" if spec.num_candidates else ""
    return text + (f", {pipeline}" if pipeline else "")


def _warm_up_peers(engine, peers: list) -> None:
    ids = engine.encode_prompt("Say hello.")
    for peer in peers:
        peer.generate(ids, 8)


def _run_peers(engine, peers: list, prompt: BenchPrompt, config: BenchConfig, baseline_ids, raw, bar) -> None:
    """Every peer on the same prompt ids (dflash2's chat template); compared with dflash2's plain output and with
    the peer's own plain decoding where it has one."""
    prompt_ids = engine.encode_prompt(prompt.text)
    own_plain: dict[str, list[int]] = {}
    for peer in peers:
        result = peer.generate(prompt_ids, config.max_new_tokens)
        own_plain[peer.name] = result.token_ids
        row = peer_row(prompt, peer, result, baseline_ids, own_plain.get(peer.plain_sibling))
        raw.write(json.dumps(row) + "\n")
        raw.flush()
        bar.set_postfix(method=peer.name, tps=f"{row['decode_tokens_per_s']:.1f}")
        bar.update()


def _warm_up(engine, drafters: dict) -> None:
    for method, drafter in drafters.items():
        engine.drafter = drafter
        engine.pipeline = method_pipeline(method)
        engine.generate("Say hello.", max_new_tokens=8)


def _request_row(prompt: BenchPrompt, method: str, result, baseline_ids: list[int] | None) -> dict:
    stats = result.stats
    return {
        "suite": prompt.suite, "category": prompt.category, "prompt_id": prompt.prompt_id, "method": method,
        "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
        "prefill_seconds": stats.prefill_seconds, "decode_seconds": stats.decode_seconds,
        "tokens_per_s": stats.tokens_per_s, "decode_tokens_per_s": stats.decode_tokens_per_s,
        "tau": stats.tau, "target_forwards": stats.target_forwards,
        "acceptance_by_position": stats.acceptance_by_position,
        "drafted_by_position": stats.drafted_by_position, "accepted_by_position": stats.accepted_by_position,
        "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
        "pipeline": stats.pipeline, "predrafts": stats.predrafts, "predraft_hits": stats.predraft_hits,
        "target_idle_fraction": stats.target_idle_fraction, "drafter_idle_fraction": stats.drafter_idle_fraction,
        "finish_reason": result.finish_reason,
        "matches_baseline": None if baseline_ids is None else result.token_ids == baseline_ids,
        "token_ids": result.token_ids,
    }


def summarize(raw_path: Path) -> list[dict]:
    """Per category and overall, per method: mean decode tokens/s, the baseline's on the same prompts, speedup
    (ratio of means, Spec-Bench style), tau, pooled acceptance by position, share of outputs identical to plain;
    and what decode speed leaves out: the mean time to first token (prefill, a draft model's included) and the
    end-to-end speedup (tokens over prefill + decode seconds, ratio of means against the baseline's)."""
    rows = [json.loads(line) for line in raw_path.read_text().splitlines() if line.strip()]
    baseline = {(r["category"], r["prompt_id"]): r for r in rows if r["method"] == BASELINE}
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        for category in (row["category"], "overall"):
            groups.setdefault((category, row["method"]), []).append(row)
    summary = []
    for (category, method), group in groups.items():
        paired = [r for r in group if (r["category"], r["prompt_id"]) in baseline]
        tokens_per_s = mean(r["decode_tokens_per_s"] for r in group)
        ar_tokens_per_s = mean(baseline[(r["category"], r["prompt_id"])]["decode_tokens_per_s"] for r in paired) \
            if paired else None
        matches = [r["matches_baseline"] for r in group if r["matches_baseline"] is not None]
        end_to_end = _mean_known(r.get("tokens_per_s") for r in group)
        ar_end_to_end = _mean_known(baseline[(r["category"], r["prompt_id"])].get("tokens_per_s") for r in paired)
        summary.append({
            "category": category, "method": method, "requests": len(group),
            "tokens_per_s": tokens_per_s, "ar_tokens_per_s": ar_tokens_per_s,
            "speedup": tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else None,
            "tau": _mean_known(r["tau"] for r in group),
            "acceptance_by_position": _pooled_acceptance(group),
            "identical_to_ar": (sum(matches) / len(matches)) if matches else None,
            "ttft_s": _mean_known(r.get("prefill_seconds") for r in group),
            "end_to_end_speedup": end_to_end / ar_end_to_end if end_to_end and ar_end_to_end else None,
            **_bubble_summary(group),
            "peer": bool(group[0].get("peer")), **own_plain_columns(group, rows),
        })
    return sorted(summary, key=lambda s: (s["category"] == "overall", s["category"], s["method"] != BASELINE,
                                          s["peer"], s["method"]))


def _mean_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return mean(known) if known else None


def _bubble_summary(rows: list[dict]) -> dict:
    """Mean idle fractions of each side and the pooled pre-draft hit rate (rows from older runs lack them)."""
    rows = [r for r in rows if "target_idle_fraction" in r]
    if not rows:
        return {}
    predrafts = sum(r["predrafts"] for r in rows)
    return {
        "target_idle": mean(r["target_idle_fraction"] for r in rows),
        "drafter_idle": mean(r["drafter_idle_fraction"] for r in rows),
        "predraft_hit_rate": sum(r["predraft_hits"] for r in rows) / predrafts if predrafts else None,
    }


def _pooled_acceptance(rows: list[dict]) -> list[float]:
    """Accepted / drafted at each draft position, summed over all steps of all requests."""
    drafted: list[int] = []
    accepted: list[int] = []
    for row in rows:
        for position, (d, a) in enumerate(zip(row["drafted_by_position"], row["accepted_by_position"])):
            if position == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[position] += d
            accepted[position] += a
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def format_summary(summary: list[dict]) -> str:
    lines = [f"{'category':16s} {'method':21s} {'n':>4s} {'tok/s':>8s} {'AR tok/s':>8s} {'speedup':>8s} {'tau':>6s} "
             f"{'identical':>9s} {'idle T/D':>9s} {'hits':>5s} {'TTFT s':>7s} {'e2e':>6s}"]
    for s in summary:
        speedup = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        ar = f"{s['ar_tokens_per_s']:.2f}" if s["ar_tokens_per_s"] is not None else "-"
        identical = f"{s['identical_to_ar']:.0%}" if s["identical_to_ar"] is not None else "-"
        tau = f"{s['tau']:6.2f}" if s["tau"] is not None else f"{'-':>6s}"
        idle = f"{s['target_idle']:.0%}/{s['drafter_idle']:.0%}" if "target_idle" in s else "-"
        hits = f"{s['predraft_hit_rate']:.0%}" if s.get("predraft_hit_rate") is not None else "-"
        ttft = f"{s['ttft_s']:.2f}" if s.get("ttft_s") is not None else "-"
        end_to_end = f"{s['end_to_end_speedup']:.2f}x" if s.get("end_to_end_speedup") is not None else "-"
        lines.append(f"{s['category']:16s} {s['method']:21s} {s['requests']:4d} {s['tokens_per_s']:8.2f} {ar:>8s} "
                     f"{speedup:>8s} {tau} {identical:>9s} {idle:>9s} {hits:>5s} {ttft:>7s} {end_to_end:>6s}")
    return "\n".join(lines)


def _run_info(engine, config: BenchConfig) -> dict:
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "target": engine.name,
        "dtype": str(engine.target.dtype), "device": str(engine.target.device),
        "weights": weight_format(engine.target),
        "threads": torch.get_num_threads(), "machine": platform.platform(), "processor": processor_name(),
        "suites": config.suites, "methods": config.methods, "limit": config.limit,
        "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
    }


def processor_name() -> str:
    """The CPU's model name (:func:`dflash2.platform.cpu`, read once; platform.processor() where /proc/cpuinfo has
    none, which is often empty on Linux) with its core count."""
    name = cpu().name or platform.processor()
    return f"{name or 'unknown CPU'}, {os.cpu_count()} logical CPUs"
