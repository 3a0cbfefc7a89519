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


class _CharTokenizer:
    """One id per character: enough to check where the parser cuts the tool's output."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _speculative_peer(max_new=8):
    from pathlib import Path

    from dflash2.peers import PeerSetup
    from dflash2.peers.llamacpp import LlamaCppSpeculativePeer

    peer = LlamaCppSpeculativePeer.__new__(LlamaCppSpeculativePeer)
    peer.tokenizer = _CharTokenizer()
    peer.setup = PeerSetup(Path("t"), Path("t.gguf"), Path("d"), Path("d.gguf"), "bf16", 2, frozenset({0}))
    return peer


# the statistics llama-speculative-simple prints on stderr (format of its source, examples/speculative-simple)
STDERR = """main: some loading line
1.01.995.129 I encoded    5 tokens in    0.250 seconds, speed:   20.000 t/s
1.01.995.140 I decoded    6 tokens in    0.500 seconds, speed:   12.000 t/s

1.01.995.141 I n_draft   = 16
1.01.995.141 I n_predict = 6
1.01.995.142 I n_drafted = 8
1.01.995.142 I n_accept  = 4
1.01.995.143 I accept    = 50.000%
"""


def test_speculative_tool_output_is_parsed_into_ids_times_and_tau():
    peer = _speculative_peer()
    result = peer._parse("\n\nPROMPabc\ndef\n\n\n\n", STDERR, "PROMP", prompt_tokens=5, max_new=8)
    assert result.token_ids == [ord(c) for c in "abc\ndef"]
    assert (result.prefill_seconds, result.decode_seconds) == (0.25, 0.5)
    assert result.target_forwards == 2 and result.drafted == 8 and result.accepted == 4  # 6 tokens in 2 passes
    assert result.finish_reason == "eos"  # 6 < 8 tokens: it stopped at EOS


def test_speculative_tool_output_is_refused_when_unreadable():
    from dflash2.peers import PeerError

    with pytest.raises(PeerError, match="echo the prompt"):
        _speculative_peer()._parse("\n\nOTHERabc\n\n\n\n", STDERR, "PROMP", prompt_tokens=5, max_new=8)
    with pytest.raises(PeerError, match="statistics"):
        _speculative_peer()._parse("\n\nPROMPabc\n\n\n\n", "crash", "PROMP", prompt_tokens=5, max_new=8)
