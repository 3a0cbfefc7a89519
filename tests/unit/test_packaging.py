"""Packaging basics: the LICENSE file is the license pyproject.toml declares, ``dflash2 --version`` is the installed
distribution's version."""

from __future__ import annotations

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
