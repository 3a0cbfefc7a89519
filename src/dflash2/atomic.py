"""Files written whole or not at all: write a temporary sibling, then rename it onto the path (``os.replace`` is
atomic on one file system), so a reader, or a resumed run after a kill, sees the old file, the new one or none, never
half of one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


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


@contextlib.contextmanager
def durable_file(path: str | Path, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file open for writing whose content becomes ``path`` when the block ends without an error: for the
    large files several processes share (the model store's GGUF files, the quantized caches). Unlike
    :func:`atomic_path` the temporary sibling's name is unique (two processes writing one path never share it), and
    its bytes are synced to disk before the rename (a crash right after leaves the whole file or none); it gets
    ``mode`` (a temporary file is private). Removed when the block raises, the error kept."""
    path = Path(path)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path.write_text(text)``, atomically."""
    with atomic_path(path) as partial:
        partial.write_text(text)


def save_tensors_atomic(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, atomically, and with ``metadata`` in sorted key
    order: safetensors keeps it in a Rust hash map, whose order changes from one map to the next, so the same
    content would give other bytes."""
    from safetensors.torch import save, save_file

    with atomic_path(path) as partial:
        if not metadata:
            save_file(tensors, str(partial))
            return
        raw = save(tensors)  # (no metadata: a deterministic header, 8-byte length first, then JSON)
        length = int.from_bytes(raw[:8], "little")
        header = {"__metadata__": dict(sorted(metadata.items())), **json.loads(raw[8 : 8 + length])}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()  # (as safetensors writes it)
        text += b" " * (-len(text) % 8)  # (the data 8-byte aligned, as safetensors pads it)
        partial.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
