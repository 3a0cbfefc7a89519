"""Evaluation prompts, read from the repository's ``data/eval`` (never trained on; sources in data/README.md)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash2 import platform

SUITES = ("humaneval", "gsm8k", "mt_bench", "spec_bench", "long_context")
SPEC_BENCH_MT_IDS = range(81, 161)  # Spec-Bench's first 80 questions are MT-bench's


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    category: str
    prompt_id: str
    text: str  # the user turn, already formatted with the suite's protocol


REPO_DATA = Path(__file__).resolve().parents[3] / "data"  # <checkout>/data (src/dflash2/bench/datasets.py)


def data_root(explicit: str | Path | None = None) -> Path:
    """``explicit``, else ``$DFLASH2_DATA``, else the checkout's ``data/``: the folder holding ``eval/``."""
    root = Path(explicit or platform.settings().data or REPO_DATA)
    if not (root / "eval").is_dir():
        raise FileNotFoundError(
            f"evaluation data not found: {root} has no eval/ folder (the eval sets ship in the repository's data/; "
            "outside a source checkout pass --data or set DFLASH2_DATA to a folder holding eval/)")
    return root


def load_suite(suite: str, limit: int | None = None, data: str | Path | None = None) -> list[BenchPrompt]:
    """Prompts of one suite; ``limit`` keeps the first N (per category for spec_bench)."""
    loaders = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mt_bench": _mt_bench, "spec_bench": _spec_bench,
               "long_context": _long_context}
    if suite not in loaders:
        raise ValueError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    prompts = loaders[suite](data_root(data) / "eval")
    if limit is None:
        return prompts
    if limit <= 0:
        raise ValueError(f"--limit must be > 0, got {limit}")
    kept: dict[str, int] = {}
    out = []
    for prompt in prompts:
        if kept.get(prompt.category, 0) < limit:
            kept[prompt.category] = kept.get(prompt.category, 0) + 1
            out.append(prompt)
    return out


REFERENCE_FILES = {"humaneval": Path("humaneval/HumanEval.jsonl.gz"), "gsm8k": Path("gsm8k/test.jsonl")}


def reference_rows(suite: str, data: str | Path | None = None) -> list[dict]:
    """The stored rows of a scored suite (answers, tests), in the order of :func:`load_suite`'s prompts."""
    if suite not in REFERENCE_FILES:
        raise ValueError(f"suite {suite!r} has no references; choose one of {', '.join(REFERENCE_FILES)}")
    return _jsonl(data_root(data) / "eval" / REFERENCE_FILES[suite])


def load_suites(suites: Sequence[str], limit: int | None = None, data: str | Path | None = None) -> list[BenchPrompt]:
    """The prompts of several suites in order, each (category, prompt id) once: Spec-Bench's ``mt_bench``
    category holds MT-bench questions, which the ``mt_bench`` suite already brings."""
    unique: dict[tuple[str, str], BenchPrompt] = {}
    for suite in suites:
        for prompt in load_suite(suite, limit, data):
            unique.setdefault((prompt.category, prompt.prompt_id), prompt)
    return list(unique.values())


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _humaneval(root: Path) -> list[BenchPrompt]:
    template = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
    return [BenchPrompt("humaneval", "humaneval", row["task_id"], template.format(row["prompt"]))
            for row in _jsonl(root / "humaneval" / "HumanEval.jsonl.gz")]


def _gsm8k(root: Path) -> list[BenchPrompt]:
    suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    return [BenchPrompt("gsm8k", "gsm8k", str(i), row["question"] + suffix)
            for i, row in enumerate(_jsonl(root / "gsm8k" / "test.jsonl"))]


def _mt_bench(root: Path) -> list[BenchPrompt]:
    return [BenchPrompt("mt_bench", "mt_bench", str(row["question_id"]), row["turns"][0])
            for row in _jsonl(root / "mt_bench" / "question.jsonl")]


def _long_context(root: Path) -> list[BenchPrompt]:
    """Source files of permissively licensed packages with a question each, 6-14K tokens: verification over
    thousands of cached positions (written by scripts/make_long_context.py)."""
    return [BenchPrompt("long_context", "long_context", row["prompt_id"], row["text"])
            for row in _jsonl(root / "long_context" / "prompts.jsonl.gz")]


def _spec_bench(root: Path) -> list[BenchPrompt]:
    rows = _jsonl(root / "spec_bench" / "question.jsonl")
    return [
        BenchPrompt("spec_bench", "mt_bench" if row["question_id"] in SPEC_BENCH_MT_IDS else row["category"],
                    str(row["question_id"]), row["turns"][0])
        for row in rows
    ]
