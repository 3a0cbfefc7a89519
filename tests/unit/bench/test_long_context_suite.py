"""The bench's long-context suite (data/eval/long_context, written by scripts/make_long_context.py): source files of
permissively licensed packages with a question each, every package's license shipped beside them."""

from __future__ import annotations

import gzip
import json

from dflash2.bench.datasets import data_root, load_suite


def _rows() -> list[dict]:
    with gzip.open(data_root() / "eval" / "long_context" / "prompts.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_prompts_hold_a_whole_source_file_and_a_question():
    prompts = load_suite("long_context")
    rows = _rows()
    assert [p.prompt_id for p in prompts] == [r["prompt_id"] for r in rows] and len(prompts) >= 8
    for prompt, row in zip(prompts, rows):
        assert prompt.category == "long_context"
        head, code_and_question = prompt.text.split("```python\n", 1)
        code, question = code_and_question.rsplit("```\n\n", 1)
        assert row["path"] in head and row["version"] in head
        assert len(code) == row["chars"] and 20_000 <= len(code) <= 60_000  # ~6-14K tokens of Qwen2.5's tokenizer
        assert len(question) > 80 and question.rstrip()[-1] in ".?"
    assert load_suite("long_context", limit=2) == prompts[:2]


def test_every_package_ships_its_license():
    licenses = data_root() / "eval" / "long_context" / "licenses"
    for row in _rows():
        files = [p for p in licenses.iterdir() if p.name.startswith(row["package"] + "-")]
        assert files and any("LICENSE" in p.name.upper() and p.stat().st_size > 100 for p in files), row["package"]
        assert row["license"] in ("MIT", "Apache-2.0", "BSD-3-Clause", "Apache-2.0 OR BSD-2-Clause")
