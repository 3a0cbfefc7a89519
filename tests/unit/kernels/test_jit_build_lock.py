"""The JIT build lock: a torch ``lock`` file left by a killed build no longer hangs every later process."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from dflash2.kernels.jit import build_lock


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path):
    stale = tmp_path / "lock"  # what torch's FileBaton leaves when its process dies mid-build
    stale.touch()
    with build_lock(tmp_path, timeout_s=5):
        assert not stale.exists()


def test_a_live_build_is_waited_for_and_never_robbed_of_its_lock_file(tmp_path):
    """Another process holds the build lock (building: its ``lock`` file exists): we wait, time out, and leave its
    file alone."""
    (tmp_path / "lock").touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"h = open({str(tmp_path / 'dflash2-build.lock')!r}, 'w'); fcntl.flock(h, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match="building"):
            with build_lock(tmp_path, timeout_s=0.5):
                pass
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    with build_lock(tmp_path, timeout_s=5):  # the holder died: its flock went with it
        assert not (tmp_path / "lock").exists()


def test_the_lock_is_released_after_use(tmp_path):
    with build_lock(tmp_path, timeout_s=5):
        pass
    with open(tmp_path / "dflash2-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held
