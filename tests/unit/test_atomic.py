"""dflash2.atomic: a file is replaced whole or left as it was."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dflash2.atomic import atomic_path, save_tensors_atomic, write_text_atomic


def test_a_finished_write_replaces_the_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    save_tensors_atomic({"x": torch.arange(3)}, tmp_path / "shard.safetensors")
    assert torch.equal(load_file(str(tmp_path / "shard.safetensors"))["x"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard.safetensors"]


def test_a_write_that_fails_halfway_leaves_the_old_file_and_no_partial(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as partial:
            partial.write_text("half of the ne")
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_durable_file_is_renamed_into_place_shared_and_removed_on_failure(tmp_path):
    import stat

    from dflash2.atomic import durable_file

    path = tmp_path / "model.gguf"
    with durable_file(path) as out:
        out.write(b"GGUF" * 4)
    assert path.read_bytes() == b"GGUF" * 4
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not the temporary file's private mode
    with pytest.raises(ValueError):
        with durable_file(path) as out:
            out.write(b"half")
            raise ValueError("a chunk's sha256 differs")
    assert path.read_bytes() == b"GGUF" * 4
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
