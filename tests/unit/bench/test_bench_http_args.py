"""`dflash2 bench serve http`'s pure parts (dflash2.bench.serve_http): llama-server's command lines and the summary's
draft acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash2.bench import serve_http as bench_http

BIN, TARGET, DRAFT = Path("/bin/llama-server"), Path("/m/target.gguf"), Path("/m/draft.gguf")


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_plain_llama_server_has_no_speculation():
    argv = bench_http.llama_argv(BIN, TARGET, 8123, slots=4, context=1024, threads=2)
    assert argv[0] == str(BIN) and _option(argv, "-m") == str(TARGET) and _option(argv, "--port") == "8123"
    assert _option(argv, "-np") == "4" and _option(argv, "-c") == "4096" and _option(argv, "-t") == "2"
    assert "--spec-type" not in argv and "-md" not in argv


def test_draft_model_speculation_names_the_draft_its_threads_and_length():
    argv = bench_http.llama_argv(BIN, TARGET, 8123, 1, 2048, 2, "draft-simple", DRAFT, draft_max=6)
    assert _option(argv, "--spec-type") == "draft-simple" and _option(argv, "-md") == str(DRAFT)
    assert _option(argv, "-td") == "2" and _option(argv, "-tbd") == "2"
    assert _option(argv, "--spec-draft-n-max") == "6"


def test_ngram_speculation_needs_no_draft_model_and_keeps_llamas_default_length():
    argv = bench_http.llama_argv(BIN, TARGET, 8123, 1, 2048, 2, "ngram-mod")
    assert _option(argv, "--spec-type") == "ngram-mod"
    assert "-md" not in argv and "--spec-draft-n-max" not in argv


def test_summary_reports_acceptance_only_where_the_server_counts_drafts():
    def row(config, drafted, accepted):
        reply = {"timings": {"draft_n": drafted, "draft_n_accepted": accepted}}
        return {"config": config, "clients": 1, "round": 0, "prompt_id": "p", "ok": True, "completion_tokens": 10,
                "latency_s": 1.0, "error": "", "drafted": drafted, "accepted": accepted,
                "target_forwards": bench_http.target_forwards(reply, 10)}

    rows = [row("llamacpp", None, None), row("llamacpp@draft-simple", 8, 6), row("llamacpp@draft-simple", 2, 1)]
    lines = bench_http.summarize(rows, {("llamacpp", 1): 2.0, ("llamacpp@draft-simple", 1): 1.0},
                                 ["llamacpp", "llamacpp@draft-simple"])
    by_config = {line["config"]: line for line in lines}
    assert by_config["llamacpp"]["draft_accepted"] is None
    assert by_config["llamacpp@draft-simple"]["draft_accepted"] == 0.7  # 7 of 10 drafted
    assert by_config["llamacpp@draft-simple"]["vs_first"] == 4.0  # 20 tokens in 1 s against 10 in 2 s
    assert by_config["llamacpp"]["tau"] == 1.0 and by_config["llamacpp@draft-simple"]["tau"] == 1.54  # 20 / 13
    assert "| llamacpp | 1 | 1 (0) | 10 | 2.0 | 5.0 | 1.0x | 1.0 | 1.0 | - |" in bench_http.table(lines)


def test_target_passes_come_from_dflash2s_own_count_or_llamas_accepted_drafts():
    assert bench_http.target_forwards({"dflash2": {"target_forwards": 7}}, 20) == 7
    assert bench_http.target_forwards({"timings": {"draft_n": 12, "draft_n_accepted": 9}}, 20) == 11
    assert bench_http.target_forwards({"timings": {}}, 20) == 20  # plain llama-server: one pass per token
    assert bench_http.target_forwards({}, 20) is None


def test_draft_model_speculation_without_a_draft_model_is_refused_before_any_load(tmp_path, monkeypatch):
    (tmp_path / "llama-server").write_text("")  # (the binary's presence is checked first)
    monkeypatch.setattr("dflash2.peers.llamacpp.llama_cpp_bin_dir", lambda: tmp_path)
    with pytest.raises(SystemExit, match="pass --draft-model"):
        bench_http.llama_command("some-local-dir", 1, 512, "draft-simple", None)
    assert bench_http.store.default_draft("qwen-1.5b") == "qwen2.5-coder-0.5b-instruct"
    assert bench_http.store.default_draft("smollm2") is None
