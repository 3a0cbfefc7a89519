"""The repository speaks of itself by dates, commits and machines, never by numbered work periods.

A reader who was not there learns nothing from "session 41" or "this session"; a date, a commit and a CPU model
say when, what and where. This scans the tracked text files of the places a reader looks (README, docs, code,
scripts, tests, data notes, changelog) and names every offending line.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["README.md", "CHANGELOG.md", "Makefile", "data/README.md", "docs", "src", "scripts", "tests"]
# "session 41", "sessions 38-43", "Session 29-30"; "this / last / next / previous / earlier / later session(s)".
WORK_PERIOD = re.compile(
    r"\bsessions?\s+\d+|\b(this|last|next|previous|earlier|later|that|each)\s+sessions?\b|\bmulti-session\b",
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *SCANNED], cwd=ROOT, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return [path for path in paths if path.is_file() and path.resolve() != Path(__file__).resolve()]


def offending_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # a binary file (weights, images): no prose in it
        return []
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
            for number, line in enumerate(text.splitlines(), start=1) if WORK_PERIOD.search(line)]


def test_pattern_catches_work_periods_and_spares_other_sessions():
    for text in ("measured in session 41", "Sessions 38-43 saw", "(Session 29-30)", "until this session",
                 "a later session trained", "a multi-session job"):
        assert WORK_PERIOD.search(text), text
    for text in ('@pytest.fixture(scope="session")', "the child gets its own session", "a new session tag",
                 "start_new_session=True", "2026-12-05 (Intel Xeon (AMX), commit 02a0d9c)"):
        assert not WORK_PERIOD.search(text), text


def test_no_text_refers_to_a_numbered_work_period():
    files = tracked_text_files()
    assert any(path.name == "README.md" for path in files)  # the scan reached the files it is meant for
    found = [hit for path in files for hit in offending_lines(path)]
    assert not found, "name the date, commit and machine instead:\n" + "\n".join(found)
