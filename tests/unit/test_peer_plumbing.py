"""Peer runners' pure plumbing: names, EOS cut, speeds and tau, raw rows, summary columns vs the peer's own plain."""

import json

import pytest

from dflash2.bench.datasets import BenchPrompt
from dflash2.bench.peer_rows import peer_row
from dflash2.bench.runner import format_summary, summarize
from dflash2.peers import PEER_NAMES, PeerResult, parse_peer_names
from dflash2.peers.base import cut_at_eos


def test_peer_names_are_validated_and_put_plain_siblings_first():
    assert parse_peer_names(None) == ()
    assert parse_peer_names("llamacpp-spec,transformers-assisted,llamacpp") == (
        "transformers-assisted", "llamacpp", "llamacpp-spec")
    assert parse_peer_names("all") == PEER_NAMES
    with pytest.raises(ValueError, match="vllm"):
        parse_peer_names("transformers,vllm")


def test_cut_at_eos_keeps_tokens_before_the_first_eos():
    assert cut_at_eos([5, 6, 2, 7, 2], frozenset({2})) == ([5, 6], "eos")
    assert cut_at_eos([5, 6], frozenset({2})) == ([5, 6], "length")


def test_result_speeds_exclude_the_first_token_from_decode_and_tau_counts_target_passes():
    result = PeerResult([1, 2, 3, 4, 5], prompt_tokens=10, prefill_seconds=1.0, decode_seconds=2.0,
                        target_forwards=2)
    assert result.decode_tokens_per_s == 2.0 and result.tokens_per_s == 5 / 3 and result.tau == 2.5
    assert PeerResult([1], 3, 1.0, 0.0).tau is None and PeerResult([1], 3, 1.0, 0.0).decode_tokens_per_s == 0.0


class _Peer:
    def __init__(self, name, plain_sibling=None):
        self.name, self.plain_sibling = name, plain_sibling


def _dflash_plain(prompt, tps, ids):
    return {"suite": prompt.suite, "category": prompt.category, "prompt_id": prompt.prompt_id, "method": "none",
            "decode_tokens_per_s": tps, "tau": 1.0, "drafted_by_position": [], "accepted_by_position": [],
            "matches_baseline": None, "token_ids": ids}


def test_peer_rows_compare_with_dflash2_plain_and_their_own_plain_and_summarize(tmp_path):
    prompts = [BenchPrompt("gsm8k", "gsm8k", str(i), "q") for i in range(2)]
    plain_peer, spec_peer = _Peer("llamacpp"), _Peer("llamacpp-spec", "llamacpp")
    rows = []
    for prompt, (own, spec) in zip(prompts, [([1, 2, 3], [1, 2, 3]), ([4, 5, 6], [4, 5, 9])]):
        rows.append(_dflash_plain(prompt, 4.0, [1, 2, 3]))
        plain = PeerResult(own, 7, 0.5, 1.0, target_forwards=3)  # 2 tok/s
        rows.append(peer_row(prompt, plain_peer, plain, [1, 2, 3], None))
        speculative = PeerResult(spec, 7, 0.5, 0.5, target_forwards=1, drafted=4, accepted=2)  # 4 tok/s
        rows.append(peer_row(prompt, spec_peer, speculative, [1, 2, 3], own))
    assert rows[2]["matches_own_plain"] is True and rows[5]["matches_own_plain"] is False
    assert rows[1]["matches_baseline"] is True and rows[4]["matches_baseline"] is False
    raw = tmp_path / "requests.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {(s["category"], s["method"]): s for s in summarize(raw)}
    spec = summary[("gsm8k", "llamacpp-spec")]
    assert spec["peer"] and spec["speedup"] == 1.0 and spec["speedup_vs_own_plain"] == 2.0
    assert spec["identical_to_own_plain"] == 0.5 and spec["tau"] == 3.0
    plain = summary[("overall", "llamacpp")]
    assert plain["speedup"] == 0.5 and plain["plain_sibling"] is None and plain["speedup_vs_own_plain"] is None
    assert not summary[("gsm8k", "none")]["peer"]
    assert "llamacpp-spec" in format_summary(list(summary.values()))


def test_summary_tolerates_peers_without_tau(tmp_path):
    prompt = BenchPrompt("gsm8k", "gsm8k", "0", "q")
    rows = [_dflash_plain(prompt, 4.0, [1]), peer_row(prompt, _Peer("x"), PeerResult([1, 2], 3, 1.0, 1.0), [1], None)]
    raw = tmp_path / "requests.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    peer = [s for s in summarize(raw) if s["method"] == "x"][0]
    assert peer["tau"] is None and peer["speedup"] == 0.25
    assert format_summary([peer]).splitlines()[1].split()[6] == "-"
