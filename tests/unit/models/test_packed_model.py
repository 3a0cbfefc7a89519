"""The packed bf16 CPU path: same model as torch's bf16 within rounding, and lossless w.r.t. itself."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels import PackedLinear
from dflash2.models.loading import load_transformer
from tests.unit.decode.test_speculative_greedy import NEW_TOKENS, plain_ids, repetitive_prompt, spec_ids


@pytest.fixture(scope="module")
def packed(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "bf16")


def test_bf16_on_cpu_is_packed_by_default_and_fp32_is_not(packed, tiny_model_dirs):
    assert isinstance(packed.layers[0].attn.wqkv, PackedLinear) and isinstance(packed.lm_head, PackedLinear)
    fp32 = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    assert isinstance(fp32.layers[0].attn.wqkv, torch.nn.Linear)


@torch.inference_mode()
def test_packed_logits_match_torch_bf16_within_rounding(packed, tiny_model_dirs):
    reference = load_transformer(tiny_model_dirs["qwen2"], "bf16", packed=False)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    got, expected = packed(ids).logits, reference(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("k", [1, 4, 8, 15])
def test_speculation_is_lossless_with_respect_to_the_packed_target(packed, k):
    prompt = repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    expected = plain_ids(packed, prompt, capacity)
    stats = DecodeStats()
    assert spec_ids(packed, ModelDrafter(packed, k), prompt, capacity, stats=stats) == expected
    assert spec_ids(packed, NgramDrafter(k), prompt, capacity) == expected


def test_a_packed_model_does_not_pin_its_file(tmp_path):
    """After packing, no parameter or buffer is a view of the safetensors file's memory map: one such view (the
    embedding) kept the whole file resident next to the packed weights (the 1.5B target: 6.2 GB instead of 3.7)."""
    from pathlib import Path

    import torch

    from dflash2.models.loading import load_transformer
    from tests.conftest import make_hf_model

    make_hf_model("qwen2").to(torch.bfloat16).save_pretrained(str(tmp_path))
    model = load_transformer(tmp_path, "bf16", "cpu")  # bf16 file, bf16 model: no conversion copies
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    mapped = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps.read_text().splitlines()
              if line.rstrip().endswith(".safetensors")]
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors
    for tensor in tensors:
        assert not any(lo <= tensor.data_ptr() < hi for lo, hi in mapped), "a tensor still views the file"
