"""``dflash2 bench report``: tables, plots and the terminal headline from a run directory's raw rows."""

import json

import pytest

from dflash2.bench.report import load_run, markdown_table, roofline_rows, write_report
from dflash2.cli import main

pytest.importorskip("matplotlib", reason="the report's plots need the bench extra")


def _row(category, prompt_id, method, tps, tau, drafted=(), accepted=(), **extra):
    return {"suite": category, "category": category, "prompt_id": prompt_id, "method": method,
            "decode_tokens_per_s": tps, "tau": tau, "drafted_by_position": list(drafted),
            "accepted_by_position": list(accepted), "matches_baseline": None if method == "none" else True, **extra}


@pytest.fixture()
def run_dir(tmp_path):
    rows = []
    for category, base in (("humaneval", 4.0), ("gsm8k", 5.0)):
        for prompt_id in ("0", "1"):
            rows += [_row(category, prompt_id, "none", base, 1.0),
                     _row(category, prompt_id, "ngram", 3 * base, 3.0, (4, 4), (3, 2)),
                     _row(category, prompt_id, "llamacpp", 8 * base, 1.0, peer=True, plain_sibling=None),
                     _row(category, prompt_id, "llamacpp-spec", 6 * base, 2.5, peer=True,
                          plain_sibling="llamacpp", matches_own_plain=prompt_id == "0")]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"target": "qwen", "dtype": "torch.bfloat16", "read_bandwidth_GBps": 20.0,
            "weight_bytes_per_token": 3_000_000_000, "gguf_bytes_per_token": 1_000_000_000}
    (tmp_path / "run.json").write_text(json.dumps(info))
    return tmp_path


def test_report_writes_tables_plots_and_html(run_dir):
    md_path, table = write_report(run_dir, html_page=True)
    markdown = md_path.read_text()
    assert "| overall | llama.cpp 4-bit speculative (0.5B) | 4 | 27.00 | 6.00x | 0.75x | 2.50 | 100% | 50% |" in markdown
    assert "| overall | dflash2 ngram | 4 | 13.50 | 3.00x | - | 3.00 |" in markdown
    overall = [line.split(" | ")[1] for line in markdown.splitlines() if line.startswith("| overall")]
    assert overall[:2] == ["dflash2 plain", "dflash2 ngram"]  # dflash2's methods first, then the peers
    for name in ("speedup", "tau", "acceptance", "roofline"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 5000
        assert f"plots/{name}.png" in markdown
    assert "<table>" in (run_dir / "report.html").read_text()
    assert table.splitlines()[0].startswith("category") and "dflash2 ngram" in table


def test_roofline_rows_divide_bandwidth_by_bytes_per_token(run_dir):
    rows = roofline_rows(load_run(run_dir))
    assert [r[-1] for r in rows] == ["6.7", "20.0"]


def test_markdown_table_has_a_separator_per_column():
    assert markdown_table(["a", "b"], [["1", "2"]]).splitlines() == ["| a | b |", "| --- | --- |", "| 1 | 2 |"]


def test_cli_report_prints_the_headline_and_refuses_a_missing_run(run_dir, tmp_path, capsys):
    assert main(["bench", "report", str(run_dir)]) == 0
    assert "llama.cpp 4-bit" in capsys.readouterr().out
    assert main(["bench", "report", str(tmp_path / "nothing")]) == 2
    assert "requests.jsonl" in capsys.readouterr().err


def test_labels_name_the_draft_shape_and_pipeline():
    from dflash2.bench.report import label

    assert label("none") == "dflash2 plain"
    assert label("dflash2+ngram:2") == "dflash2 DFlash2 + ngram k=2"
    assert label("dflash2:3x3") == "dflash2 DFlash2 k=3 tree x3"
    assert label("model@overlap") == "dflash2 model (0.5B), overlap"
    assert label("llamacpp-spec") == "llama.cpp 4-bit speculative (0.5B)"


def test_best_configuration_against_the_peers(run_dir):
    from dflash2.bench.report import best_vs_peers

    header, rows = best_vs_peers(load_run(run_dir))
    assert header == ["category", "dflash2 plain", "dflash2 ngram", "llama.cpp 4-bit",
                      "llama.cpp 4-bit speculative (0.5B)", "best / fastest peer"]
    assert rows[0] == ["gsm8k", "5.00", "15.00", "40.00", "30.00", "0.38x"]
    assert rows[-1][0] == "overall" and rows[-1][-1] == f"{13.5 / 36:.2f}x"
    assert "against the peers" in write_report(run_dir)[0].read_text()
