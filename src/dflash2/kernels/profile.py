"""What the kernels chosen on this machine mean for the layers above: :func:`draft_hardware` describes how a loaded
target runs (AMX tiles or not) and how the bf16 and gguf kernels would run a drafter, for the drafter defaults
(:class:`dflash2.platform.DraftHardware`). The drafters take that description as an argument instead of asking the
CPU or the kernels themselves."""

from __future__ import annotations

from torch import nn

from dflash2.kernels import gguf_linear, packed_linear
from dflash2.platform import DraftHardware

__all__ = ["draft_hardware"]


def draft_hardware(target: nn.Module | None = None) -> DraftHardware:
    """The drafter-relevant facts of ``target`` (a Transformer; None: no target, its layers on no tiles) on this
    machine. Inspecting the target's layers is cheap; whether the bf16 kernel runs on AMX tiles and which gguf kernel
    is chosen are answered when first asked (each loads its kernel)."""
    return DraftHardware(tile_verification=packed_linear.tile_verification(target),
                         amx_verification=packed_linear.amx_verification(target),
                         bf16_on_amx=packed_linear.amx_usable, gguf_backend=gguf_linear.gguf_backend)
