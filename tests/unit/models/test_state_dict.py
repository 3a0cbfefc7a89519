"""Reading a model directory's safetensors: the memory-mapped and the plain-read paths give the same tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dflash2.models.state_dict import read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 7, generator=generator),
        "b.weight": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
        "c.bias": torch.randn(6, generator=generator).to(torch.float16),
        "d.index": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "e.scalar": torch.tensor(2.5),
    }


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_both_paths_read_every_tensor_bitwise(tmp_path, mapped) -> None:
    tensors = _tensors()
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "model-00001.safetensors"), metadata={"format": "pt"})
    save_file(dict(list(tensors.items())[2:]), str(tmp_path / "model-00002.safetensors"))
    read = read_safetensors(tmp_path, mapped=mapped)
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape
        assert torch.equal(read[name], tensor), name
    kept = read_safetensors(tmp_path, keep=lambda name: name.endswith(".weight"), mapped=mapped)
    assert sorted(kept) == ["a.weight", "b.weight"]


def test_the_plain_read_owns_its_memory_and_refuses_a_truncated_file(tmp_path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    read = read_safetensors(tmp_path, mapped=False)
    read["a.weight"].add_(1.0)  # writable, not a view of a read-only map
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors(tmp_path, mapped=False)
