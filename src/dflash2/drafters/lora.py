"""LoRA adapters on a decoder's projections: what ``dflash2 train pard`` trains and ships (drafters/pard.py merges
them into the weights at load, so a draft pass costs nothing extra)."""

from __future__ import annotations

import torch
from torch import nn

from dflash2.models.decoder import Transformer

LORA_TARGETS = ("wqkv", "wo", "w_gate_up", "w_down")  # the decoder's (fused) projections
MERGE_BLOCK = 1 << 20  # fp32 elements per block of rows in LoRALinear.merged


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * x @ A^T @ B^T`` with the base frozen; B starts at zero (no change at first)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=dtype, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        update = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T
        return self.base(x) + (self.scale * update).to(x.dtype)

    def delta(self) -> torch.Tensor:
        """[out, in] float32: the weight update the adapter stands for."""
        return self.scale * (self.lora_b.float() @ self.lora_a.float())

    def merged(self) -> nn.Linear:
        """A plain linear layer with the update added to the base weight (in the base's dtype): ``W + delta`` in
        fp32, rounded once, a block of rows at a time (~4 MB of fp32 each, in cache: the 0.5B's merge 1.6 -> 0.6 s;
        one product per block instead of one for the whole weight gave the same bits where compared)."""
        weight = self.base.weight.detach()
        a, b = self.lora_a.detach().float(), self.lora_b.detach().float()
        merged = torch.empty_like(weight)
        rows = max(16, MERGE_BLOCK // weight.shape[1])
        for start in range(0, weight.shape[0], rows):
            block = slice(start, start + rows)
            merged[block] = (weight[block].float() + self.scale * (b[block] @ a)).to(weight.dtype)
        with torch.device("meta"):  # no random initialisation of a weight replaced at once (2 s for the 0.5B)
            linear = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                               dtype=weight.dtype)
        linear.weight = nn.Parameter(merged, requires_grad=False)
        if self.base.bias is not None:
            linear.bias = nn.Parameter(self.base.bias.detach().clone(), requires_grad=False)
        return linear.requires_grad_(False)


def add_lora(model: Transformer, rank: int, alpha: float,
             targets: tuple[str, ...] = LORA_TARGETS) -> list[nn.Parameter]:
    """Wrap the ``targets`` projections of every layer in :class:`LoRALinear`; returns the new parameters."""
    if rank <= 0:
        return []
    params: list[nn.Parameter] = []
    for layer in model.layers:
        for owner, name in _projections(layer, targets):
            wrapped = LoRALinear(getattr(owner, name), rank, alpha)
            setattr(owner, name, wrapped)
            params += [wrapped.lora_a, wrapped.lora_b]
    return params


def merge_lora(model: Transformer) -> None:
    """Replace every :class:`LoRALinear` by its merged plain linear layer (inference)."""
    for layer in model.layers:
        for owner, name in _projections(layer, LORA_TARGETS):
            module = getattr(owner, name)
            if isinstance(module, LoRALinear):
                setattr(owner, name, module.merged())


def _projections(layer, targets):
    for owner, name in ((layer.attn, "wqkv"), (layer.attn, "wo"), (layer.ffn, "w_gate_up"), (layer.ffn, "w_down")):
        if name in targets:
            yield owner, name


def adapter_state(model: Transformer, mask_embedding: torch.Tensor, dtype: torch.dtype = torch.float32
                  ) -> dict[str, torch.Tensor]:
    """What training changed: ``layers.{i}.{proj}.lora_a/lora_b`` and ``mask_embedding`` [D]."""
    state = {"mask_embedding": mask_embedding.detach().to(dtype).contiguous()}
    for index, layer in enumerate(model.layers):
        for owner, name in _projections(layer, LORA_TARGETS):
            module = getattr(owner, name)
            if isinstance(module, LoRALinear):
                state[f"layers.{index}.{name}.lora_a"] = module.lora_a.detach().to(dtype).contiguous()
                state[f"layers.{index}.{name}.lora_b"] = module.lora_b.detach().to(dtype).contiguous()
    return state


def load_adapter_state(model: Transformer, state: dict[str, torch.Tensor], grow: bool = False) -> None:
    """Copy ``adapter_state`` tensors into the LoRA modules of ``model`` (added with the same config).

    ``grow``: the modules may have a higher rank than the state's; its A rows and B columns fill the leading ones,
    the other B columns are zeroed (their A rows keep their initialization), so with the same ``alpha / rank`` the
    layers compute what the state's adapter computed, and training can use the added rank."""
    for index, layer in enumerate(model.layers):
        for owner, name in _projections(layer, LORA_TARGETS):
            module = getattr(owner, name)
            if not isinstance(module, LoRALinear):
                continue
            a, b = state[f"layers.{index}.{name}.lora_a"], state[f"layers.{index}.{name}.lora_b"]  # [r, in], [out, r]
            if not grow:
                module.lora_a.data.copy_(a)
                module.lora_b.data.copy_(b)
                continue
            rank = a.shape[0]
            if rank > module.lora_a.shape[0]:
                raise ValueError(f"layer {index} {name}: an adapter of rank {rank} cannot grow into rank "
                                 f"{module.lora_a.shape[0]}")
            module.lora_a.data[:rank].copy_(a)
            module.lora_b.data.zero_()
            module.lora_b.data[:, :rank].copy_(b)
