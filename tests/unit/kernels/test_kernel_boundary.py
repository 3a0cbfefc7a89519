"""What the C++ kernels read through raw pointers is checked when a layer is built: a run of GGUF blocks or int8 /
int4 panels whose tensors do not fit the layout its fields describe is refused in one line, never read past."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash2.kernels.boundary import KernelInputError, check_packed_blocks, check_quant_panels
from dflash2.kernels.gguf_blocks import random_blocks
from dflash2.kernels.gguf_packing import pack_blocks
from dflash2.kernels.quant_linear import KERNEL, QuantLinear


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0"])
def test_packed_gguf_runs_fit_their_layout(qtype):
    run = pack_blocks(random_blocks(qtype, 20, 256))
    check_packed_blocks(run)  # the intact run
    damaged = {
        "weight": dataclasses.replace(run, weight=run.weight[:, :-1].contiguous()),
        "scale": dataclasses.replace(run, scale=run.scale.double()),
        "outputs": dataclasses.replace(run, out_features=run.out_features + 8),
        "group": dataclasses.replace(run, group=3),
        "contiguous": dataclasses.replace(run, scale=run.scale.transpose(0, 1)),
    }
    for what, bad in damaged.items():
        if what == "contiguous" and bad.scale.is_contiguous():
            continue
        with pytest.raises(KernelInputError) as error:
            check_packed_blocks(bad, "layers.0.attn.wqkv run 0")
        assert "\n" not in str(error.value) and str(error.value).startswith("layers.0.attn.wqkv run 0: "), what


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quant_panels_fit_their_layout(weights):
    layer = QuantLinear.from_weight(torch.randn(40, 64), torch.randn(40), weights=weights, backend=KERNEL)
    q, scale, bias = layer.weight_data, layer.scale_data, layer.bias_data
    check_quant_panels(weights, q, scale, bias, 64, 40)
    with pytest.raises(KernelInputError, match="scale"):
        QuantLinear(weights, q, scale[:-1].contiguous(), bias, 64, 40, KERNEL)
    with pytest.raises(KernelInputError, match="weight"):
        QuantLinear(weights, q.reshape(-1)[:-16].contiguous(), scale, bias, 64, 40, KERNEL)
    with pytest.raises(KernelInputError, match="bias"):
        QuantLinear(weights, q, scale, bias.half(), 64, 40, KERNEL)
