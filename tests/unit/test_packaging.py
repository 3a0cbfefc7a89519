"""Packaging basics: the LICENSE file is the license pyproject.toml declares, ``dflash2 --version`` is the installed
distribution's version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_license_file_is_the_apache_2_text_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 200  # the full text, not a notice


def test_version_flag_prints_the_package_metadata_version():
    proc = subprocess.run([sys.executable, "-m", "dflash2.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dflash2 {version('dflash2')}"


def test_the_executable_ends_without_teardown_but_keeps_its_output_and_exit_code(tmp_path):
    """`console()` leaves with os._exit: what was printed (to a pipe, so block-buffered) and the code must survive."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["dflash2"]
    assert entry == "dflash2.cli:console"
    run = [sys.executable, "-c", "from dflash2.cli import console; console()"]
    listed = subprocess.run([*run, "models", "list", "--json"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DFLASH2_HOME": str(tmp_path)})
    assert listed.returncode == 0 and json.loads(listed.stdout) is not None, (listed.stdout, listed.stderr)
    failed = subprocess.run([*run, "generate", "--model", str(tmp_path / "missing"), "hi"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "DFLASH2_HOME": str(tmp_path)})
    assert failed.returncode == 2 and failed.stderr.startswith("dflash2: error:"), (failed.returncode, failed.stderr)
