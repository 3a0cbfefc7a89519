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


def test_tensors_with_metadata_give_the_same_bytes_whatever_the_metadata_order(tmp_path):
    """safetensors keeps the metadata in a hash map whose order varies from one write to the next; sorted here."""
    from safetensors import safe_open

    tensors = {"draft_vocab": torch.arange(40, dtype=torch.int32), "other": torch.ones(3, dtype=torch.float16)}
    orders = [{"source": "a,b", "sequences": "7", "kind": "x"}, {"kind": "x", "sequences": "7", "source": "a,b"}]
    written = []
    for index in range(16):
        path = tmp_path / f"{index}.safetensors"
        save_tensors_atomic(tensors, path, metadata=orders[index % 2])
        written.append(path.read_bytes())
    assert all(raw == written[0] for raw in written)
    with safe_open(str(tmp_path / "0.safetensors"), framework="pt") as handle:
        assert handle.metadata() == orders[0]
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in tensors.items())
    assert int.from_bytes(written[0][:8], "little") % 8 == 0  # the data stay 8-byte aligned
