"""Files written whole or not at all: write a temporary sibling, then rename it onto the path (``os.replace`` is
atomic on one file system), so a reader, or a resumed run after a kill, sees the old file, the new one or none, never
half of one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write (by any means: a library, a subprocess); renamed onto ``path`` when
    the block ends without an error, removed when it raises."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path.write_text(text)``, atomically."""
    with atomic_path(path) as partial:
        partial.write_text(text)


def save_tensors_atomic(tensors: dict, path: str | Path) -> None:
    """``safetensors.torch.save_file(tensors, path)``, atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as partial:
        save_file(tensors, str(partial))
