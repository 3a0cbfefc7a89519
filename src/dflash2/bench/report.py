"""``dflash2 bench report RUN_DIR``: a Markdown (and optional HTML) page with tables and PNG plots of one run.

Reads the run's raw ``requests.jsonl`` and ``run.json`` (never edits them), recomputes the summary, writes
``report.md`` (+ ``report.html``) and ``plots/*.png`` into the run directory and returns the headline table.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from dflash2.bench.report_plots import write_plots
from dflash2.bench.runner import BASELINE, label, summarize


@dataclass(frozen=True)
class Run:
    directory: Path
    info: dict  # run.json
    rows: list[dict]  # requests.jsonl
    summary: list[dict]  # runner.summarize


def load_run(directory: Path) -> Run:
    raw = directory / "requests.jsonl"
    if not raw.is_file():
        raise FileNotFoundError(f"{directory} has no requests.jsonl (not a `dflash2 bench` run directory)")
    info_path = directory / "run.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    return Run(directory, info, rows, _in_run_order(summarize(raw), info))


def _in_run_order(summary: list[dict], info: dict) -> list[dict]:
    """Methods in the order the run lists them (dflash2's, then the peers); categories as summarize sorts them."""
    listed = [*info.get("methods", []), *info.get("peers", [])]
    rank = {method: index for index, method in enumerate(listed)}
    categories = {category: index for index, category in enumerate(dict.fromkeys(s["category"] for s in summary))}
    return sorted(summary, key=lambda s: (categories[s["category"]], s["peer"], s["method"] != BASELINE,
                                          rank.get(s["method"], len(rank)), s["method"]))


def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def headline_rows(run: Run, category: str = "overall") -> list[list[str]]:
    """One row per method of ``category``: tok/s, speedup vs dflash2 plain and vs the tool's own plain, tau,
    outputs identical to dflash2 plain and to the tool's own plain decoding, mean time to first token and
    end-to-end speedup (prefill included)."""
    rows = []
    for s in (s for s in run.summary if s["category"] == category):
        rows.append([s["category"], label(s["method"]), str(s["requests"]), _fmt(s["tokens_per_s"]),
                     _fmt(s["speedup"], "{:.2f}x"), _fmt(s.get("speedup_vs_own_plain"), "{:.2f}x"),
                     _fmt(s["tau"]), _fmt(s["identical_to_ar"], "{:.0%}"),
                     _fmt(s.get("identical_to_own_plain"), "{:.0%}"), _fmt(s.get("ttft_s")),
                     _fmt(s.get("end_to_end_speedup"), "{:.2f}x")])
    return rows


HEADLINE_HEADER = ["category", "method", "n", "decode tok/s", "vs dflash2 plain", "vs own plain", "tau",
                   "= dflash2 plain", "= own plain", "TTFT s", "end to end vs plain"]


def best_vs_peers(run: Run) -> tuple[list[str], list[list[str]]]:
    """dflash2's best configuration (the one fastest over all prompts, kept for every category) against every
    peer: decode tokens/s per category, and its ratio to the fastest peer. Empty when the run has no peer."""
    overall = [s for s in run.summary if s["category"] == "overall"]
    ours = [s for s in overall if not s["peer"] and s["method"] != BASELINE]
    peers = [s["method"] for s in overall if s["peer"]]
    if not ours or not peers:
        return [], []
    best = max(ours, key=lambda s: s["tokens_per_s"])["method"]
    header = ["category", label(BASELINE), label(best), *map(label, peers), "best / fastest peer"]
    rows = []
    for category in dict.fromkeys(s["category"] for s in run.summary):
        speed = {s["method"]: s["tokens_per_s"] for s in run.summary if s["category"] == category}
        fastest_peer = max((speed[p] for p in peers if p in speed), default=None)
        ratio = speed[best] / fastest_peer if best in speed and fastest_peer else None
        rows.append([category, *(_fmt(speed.get(m)) for m in (BASELINE, best, *peers)), _fmt(ratio, "{:.2f}x")])
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def terminal_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows])


def roofline_rows(run: Run) -> list[list[str]]:
    """Measured bandwidth and the bytes of weights each engine reads per token -> tokens/s ceilings."""
    info = run.info
    bandwidth = info.get("read_bandwidth_GBps")
    if not bandwidth:
        return []
    rows = []
    for name, key in (("dflash2 / transformers (" + info.get("dtype", "?") + ")", "weight_bytes_per_token"),
                      ("llama.cpp (GGUF)", "gguf_bytes_per_token")):
        if info.get(key):
            rows.append([name, f"{info[key] / 1e9:.2f}", f"{bandwidth:.1f}", f"{bandwidth * 1e9 / info[key]:.1f}"])
    return rows


def write_report(directory: Path, *, html_page: bool = False) -> tuple[Path, str]:
    """Write report.md (+ report.html) and plots; return the Markdown path and the terminal headline table."""
    run = load_run(directory)
    plots = write_plots(run, directory / "plots")
    categories = [c for c in dict.fromkeys(s["category"] for s in run.summary) if c != "overall"]
    parts = [f"# dflash2 bench: {directory.name}", "", _machine_line(run.info), "",
             "## Headline (all prompts)", "", markdown_table(HEADLINE_HEADER, headline_rows(run)), ""]
    versus_header, versus = best_vs_peers(run)
    if versus:
        parts += ["## dflash2's best configuration against the peers (decode tok/s)", "",
                  markdown_table(versus_header, versus), ""]
    roofline = roofline_rows(run)
    if roofline:
        parts += ["## Roofline", "", markdown_table(["engine", "GB read per token", "measured GB/s",
                                                     "tok/s ceiling (1 token per pass)"], roofline), ""]
    parts += ["## Per category", "",
              markdown_table(HEADLINE_HEADER, [r for c in categories for r in headline_rows(run, c)]), ""]
    parts += ["## Plots", ""] + [f"![{title}](plots/{path.name})\n" for title, path in plots]
    parts += ["Speedups are ratios of mean decode tokens/s on the same prompts (Spec-Bench style); tau is new tokens "
              "per target pass; raw per-request results: `requests.jsonl`.", ""]
    markdown = "\n".join(parts)
    md_path = directory / "report.md"
    md_path.write_text(markdown)
    if html_page:
        (directory / "report.html").write_text(_html(markdown))
    table = terminal_table(HEADLINE_HEADER, headline_rows(run))
    if versus:
        table += "\n\n" + terminal_table(versus_header, versus)
    return md_path, table


def _machine_line(info: dict) -> str:
    keys = ("target", "dtype", "device", "threads", "machine", "processor", "suites", "limit", "max_new_tokens",
            "peers", "target_gguf")
    return "Run: " + "; ".join(f"{k} = {info[k]}" for k in keys if info.get(k) not in (None, "", []))


def _html(markdown: str) -> str:
    """A small Markdown subset (headings, tables, images, paragraphs) as a standalone page."""
    body, table = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            if not line.startswith("| ---") and "--- |" not in line:
                table.append(line.strip("|").split("|"))
            continue
        if table:
            head, *rest = table
            body.append("<table><tr>" + "".join(f"<th>{html.escape(c.strip())}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in r) + "</tr>"
                                  for r in rest) + "</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line[level:].strip())}</h{level}>")
        elif line.startswith("!["):
            alt, src = line[2:].split("](")
            body.append(f'<p><img src="{html.escape(src.rstrip(")"))}" alt="{html.escape(alt)}" width="720"></p>')
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    style = "body{font-family:sans-serif;max-width:980px;margin:auto}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>{''.join(body)}</body></html>\n"
