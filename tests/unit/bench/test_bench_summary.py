import json

import pytest

from dflash2.bench.datasets import load_suite, load_suites
from dflash2.bench.runner import format_summary, method_name, method_pipeline, summarize


def row(category, prompt_id, method, tps, tau=1.0, drafted=(), accepted=(), matches=True):
    return {"category": category, "prompt_id": prompt_id, "method": method, "decode_tokens_per_s": tps, "tau": tau,
            "drafted_by_position": list(drafted), "accepted_by_position": list(accepted),
            "matches_baseline": matches}


def test_summary_is_ratio_of_means_with_pooled_acceptance_per_category_and_overall(tmp_path):
    rows = [
        row("a", "1", "none", 2.0), row("a", "1", "ngram", 6.0, 3.0, (4, 4), (3, 1)),
        row("a", "2", "none", 4.0), row("a", "2", "ngram", 6.0, 2.0, (2, 1), (1, 0), matches=False),
        row("b", "1", "none", 5.0), row("b", "1", "ngram", 5.0, 1.0, (1,), (0,)),
    ]
    raw = tmp_path / "requests.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {(s["category"], s["method"]): s for s in summarize(raw)}
    a = summary[("a", "ngram")]
    assert a["tokens_per_s"] == 6.0 and a["ar_tokens_per_s"] == 3.0 and a["speedup"] == 2.0
    assert a["acceptance_by_position"] == [4 / 6, 1 / 5]
    assert a["identical_to_ar"] == 0.5
    overall = summary[("overall", "ngram")]
    assert overall["requests"] == 3 and overall["speedup"] == pytest.approx((17 / 3) / (11 / 3))
    assert overall["acceptance_by_position"] == [4 / 7, 1 / 5]
    assert "overall" in format_summary(list(summary.values()))


def test_summary_shows_what_decode_speed_leaves_out_time_to_first_token_and_end_to_end(tmp_path):
    """A drafter that reads the prompt during prefill raises TTFT: the summary shows it and the end-to-end ratio."""
    rows = [dict(row("a", "1", "none", 10.0), prefill_seconds=1.0, tokens_per_s=8.0),
            dict(row("a", "1", "pard", 20.0, 2.0), prefill_seconds=2.0, tokens_per_s=12.0),
            dict(row("a", "2", "none", 10.0), prefill_seconds=3.0, tokens_per_s=6.0),
            dict(row("a", "2", "pard", 20.0, 2.0), prefill_seconds=4.0, tokens_per_s=8.0)]
    raw = tmp_path / "requests.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pard = {(s["category"], s["method"]): s for s in summarize(raw)}[("a", "pard")]
    assert pard["speedup"] == 2.0 and pard["ttft_s"] == 3.0 and pard["end_to_end_speedup"] == pytest.approx(10 / 7)
    assert "1.43x" in format_summary([pard])


@pytest.mark.parametrize("suite, first_category", [("humaneval", "humaneval"), ("gsm8k", "gsm8k"),
                                                  ("mt_bench", "mt_bench"), ("spec_bench", "mt_bench")])
def test_suites_load_with_their_prompt_formats_and_limits(suite, first_category):
    prompts = load_suite(suite, limit=2)
    assert prompts[0].category == first_category
    per_category = {}
    for prompt in prompts:
        per_category[prompt.category] = per_category.get(prompt.category, 0) + 1
    assert max(per_category.values()) == 2
    if suite == "spec_bench":
        assert {"translation", "summarization", "qa", "math_reasoning", "rag", "mt_bench"} <= set(per_category)
    if suite == "gsm8k":
        assert prompts[0].text.endswith("put your final answer within \\boxed{}.")
    if suite == "humaneval":
        assert prompts[0].text.startswith("Write a solution to the following problem")


def test_pipelines_are_separate_methods_with_their_bubbles_and_hit_rates(tmp_path):
    assert method_name("model", "overlap") == "model@overlap" and method_name("model", "sync") == "model"
    assert method_name("none", "overlap") == "none"  # plain decoding has no pipeline
    assert method_pipeline("model@overlap") == "overlap" and method_pipeline("ngram") == "sync"
    bubble = dict(target_idle_fraction=0.1, drafter_idle_fraction=0.5)
    rows = [row("a", "1", "none", 2.0), dict(row("a", "1", "model@overlap", 4.0), predrafts=10, predraft_hits=6,
                                              **bubble),
            dict(row("a", "2", "model@overlap", 4.0), predrafts=10, predraft_hits=2, **bubble)]
    raw = tmp_path / "requests.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {(s["category"], s["method"]): s for s in summarize(raw)}
    overlap = summary[("a", "model@overlap")]
    assert overlap["predraft_hit_rate"] == 0.4 and overlap["target_idle"] == 0.1 and overlap["drafter_idle"] == 0.5
    assert "predraft_hit_rate" not in summary[("a", "none")]  # rows without the fields (older runs) stay readable
    assert "40%" in format_summary(list(summary.values()))


def test_a_drafters_entry_may_carry_its_own_draft_shape():
    from dflash2.bench.cli import _draft_shape
    from dflash2.cli import CliError

    assert _draft_shape("dflash:2", 8, 1) == (2, 1) and _draft_shape("ngram", 8, 3) == (8, 3)
    assert _draft_shape("ngram", None, 1) == (None, 1) and _draft_shape("dflash2:3x4", None, 1) == (3, 4)
    for bad in ("dflash:0", "dflash:x", "dflash:-1", "dflash:3x", "dflash:3x0", "dflash:x2", "dflash:3x2x1"):
        with pytest.raises(CliError):
            _draft_shape(bad, None, 1)


def test_suites_together_bring_each_prompt_once():
    prompts = load_suites(["mt_bench", "spec_bench"], limit=2)
    keys = [(p.category, p.prompt_id) for p in prompts]
    assert len(keys) == len(set(keys))
    assert [p.suite for p in prompts if p.category == "mt_bench"] == ["mt_bench", "mt_bench"]  # not repeated
    assert len(prompts) == 2 + 5 * 2  # Spec-Bench's other five categories


def test_the_run_records_the_processor_and_its_core_count():
    import os

    from dflash2.bench.runner import processor_name

    name = processor_name()
    assert name.endswith(f", {os.cpu_count()} logical CPUs") and not name.startswith(",")
