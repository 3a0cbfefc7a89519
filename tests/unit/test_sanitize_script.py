"""The sanitizer script runs the kernels' tests by path: every path it names must exist (they moved once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sanitizer_runs_test_files_that_exist():
    spec = importlib.util.spec_from_file_location("sanitize_kernels", ROOT / "scripts" / "sanitize_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [path for path in module.KERNEL_TESTS if not (ROOT / path).is_file()]
    assert module.KERNEL_TESTS and not missing, missing
