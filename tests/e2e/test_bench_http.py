"""`dflash2 bench serve http` end to end on SmolLM2: real `dflash2 serve` processes, plain and speculative requests over
HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.e2e.conftest import SMOLLM2

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def test_http_bench_serves_every_configuration_with_the_same_greedy_tokens(tmp_path):
    out = tmp_path / "http"
    command = [sys.executable, "-m", "dflash2.cli", "bench", "serve", "http", "--model", SMOLLM2, "--weights", "bf16",
               "--configs", "dflash2-plain,dflash2,dflash2@ngram:4", "--clients", "1,2", "--requests", "3", "--max-tokens", "12",
               "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 3  # configurations x client counts x requests
    assert all(r["ok"] and r["completion_tokens"] > 0 for r in rows)
    tokens = defaultdict(dict)  # (clients, prompt) -> config -> tokens: greedy speculation is lossless
    for r in rows:
        tokens[(r["clients"], r["prompt_id"])][r["config"]] = r["completion_tokens"]
    assert all(t["dflash2"] == t["dflash2-plain"] == t["dflash2@ngram:4"] for t in tokens.values())
    summary = (out / "summary.md").read_text()
    assert "| dflash2-plain | 1 | 3 (0) |" in summary and "| dflash2@ngram:4 | 2 | 3 (0) |" in summary


def test_http_bench_refuses_unknown_configurations(tmp_path):
    command = [sys.executable, "-m", "dflash2.cli", "bench", "serve", "http", "--configs", "vllm", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown ['vllm']" in done.stderr
