"""Conditioning a block drafter on the target: the target's hidden states of the last verified position, from a
few of its layers, projected into the drafter's embedding space and added to the inputs of a draft pass's block
rows (the pending token and the mask positions).

Why the last verified position: the target's state at position n - 2 (the one that predicted the pending token
at n - 1) comes out of every verification pass for free (``Drafter.observe``), and a target's middle and upper
layers already carry what it plans past the next token (the signal EAGLE and DFlash draft from). The pretrained
drafter keeps its own view of the context (its KV cache of the committed ids, unconditioned, as the PARD
drafter's); only the rows that draft read the target.

The projection starts at zero (``proj.weight`` = 0), so an untrained conditioning leaves the PARD drafter
unchanged: a run that adds it to a trained adapter starts from exactly that adapter's drafts.

Shipped beside a PARD adapter as ``conditioning.json`` + ``conditioning.safetensors`` (``proj.weight``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

CONDITIONING_CONFIG = "conditioning.json"
CONDITIONING_FILE = "conditioning.safetensors"


@dataclass(frozen=True)
class ConditioningConfig:
    """Which target layers are read and the widths on both sides."""

    target_layers: tuple[int, ...]  # decoder layers of the target whose outputs are read (0-based)
    target_hidden_size: int  # the target's width (Dt)
    hidden_size: int  # the drafter's width (D)
    # every context position too: the row of id i (read as context) gets the offset of the target's state at i - 1
    # (what the target had verified when id i was pending), so the drafter's keys / values of the whole context
    # carry the target's states (EAGLE's fusion, as an input offset); False: the drafting rows only
    context: bool = False

    def save(self, directory: str | Path) -> None:
        (Path(directory) / CONDITIONING_CONFIG).write_text(json.dumps(config_record(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "ConditioningConfig":
        return config_from_record(cls, json.loads((Path(directory) / CONDITIONING_CONFIG).read_text()))


def config_record(config) -> dict:
    """A conditioning config (a dataclass with ``target_layers``) as JSON-ready fields."""
    return {**asdict(config), "target_layers": list(config.target_layers)}


def config_from_record(cls, record: dict):
    """:func:`config_record`'s fields back into a config of ``cls``."""
    return cls(**{**record, "target_layers": tuple(record["target_layers"])})


def normalised_taps(taps: torch.Tensor, num_taps: int, eps: float = 1e-6) -> torch.Tensor:
    """taps [..., T * Dt] (``fuse_taps``) in fp32, each tap at unit RMS without a learned scale: the target's
    residual stream carries a few huge channels that would swamp a linear map."""
    x = taps.float().unflatten(-1, (num_taps, -1))  # [..., T, Dt]
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


class TargetConditioning(nn.Module):
    """taps [..., T * Dt] (the T tapped layers' states side by side) -> [..., D] input offsets: each tap
    RMS-normalised (``normalised_taps``), then one linear map, zero-initialised."""

    def __init__(self, config: ConditioningConfig, eps: float = 1e-6) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        taps = len(config.target_layers)
        self.proj = nn.Linear(taps * config.target_hidden_size, config.hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, taps: torch.Tensor) -> torch.Tensor:  # [..., T * Dt] -> [..., D]
        x = normalised_taps(taps, len(self.config.target_layers), self.eps)  # [..., T * Dt]
        return self.proj(x.to(self.proj.weight.dtype))

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        self.config.save(directory)
        save_file({"proj.weight": self.proj.weight.detach().to(dtype).contiguous()},
                  str(Path(directory) / CONDITIONING_FILE))

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "TargetConditioning":
        from safetensors.torch import load_file

        module = cls(ConditioningConfig.load(directory))
        module.proj.weight.data = load_file(str(Path(directory) / CONDITIONING_FILE))["proj.weight"].to(dtype)
        return module.eval().requires_grad_(False)


def has_conditioning(directory: str | Path) -> bool:
    return (Path(directory) / CONDITIONING_CONFIG).exists()


def fuse_taps(hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tapped layers' states [B, n, Dt] each -> [B, n, T * Dt], in the order of ``target_layers``."""
    return torch.cat(hidden, dim=-1)
