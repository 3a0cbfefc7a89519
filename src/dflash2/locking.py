"""An exclusive lock across processes that dies with its holder (``fcntl.flock``), with a bounded wait."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class LockTimeout(TimeoutError):
    """Another process held the lock for longer than the caller would wait."""


@contextlib.contextmanager
def exclusive_flock(path: Path, timeout_s: float, waiting_message: str = "") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing). The kernel releases it when its holder dies, so
    a killed process never leaves it taken. Waits at most ``timeout_s`` for another holder, then raises
    LockTimeout; logs ``waiting_message`` once when it has to wait. A no-op where fcntl is missing (not POSIX)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as handle:
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"another process has held {path} for over {timeout_s:.0f} s") from None
                if waiting_message and not said:
                    log.warning("%s", waiting_message)
                    said = True
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
