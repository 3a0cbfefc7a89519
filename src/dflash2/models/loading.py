"""Load a Hugging Face style directory (config.json + *.safetensors) into the lean decoder. Never uses pickle.

The tensor renaming and the decoder's construction are in :mod:`dflash2.models.state_dict` (shared with the
quantized-layer cache, :mod:`dflash2.models.quant_cache`, which sits between the two)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.huge_pages import move_linear_weights
from dflash2.models.state_dict import (
    build_transformer,
    hf_to_lean_state_dict,
    parse_dtype,
    read_safetensors,
    replace_layer_projections,
    replace_linear_layers,
)

# Weight formats of the linear layers: "bf16" = not quantized (weights in the model dtype, the packed bf16 kernel
# for bf16/fp16 on a CPU); "int8" = weight-only int8 with one fp32 scale per output feature, quantized at the first
# load and cached in the model store (dflash2.models.quant_cache; CPU kernel); "int4" = weight-only 4-bit, one fp32 scale per output and group of 32 inputs (CPU kernel);
# "gguf" = the GGUF file's own quantized blocks as they are (models converted from a GGUF; dflash2.models.gguf_weights,
# kernels/gguf_linear.py: activations quantized to int8 per block of 32, integer dot products).
# Embeddings and norms stay in the model dtype.
WEIGHT_FORMATS = ("bf16", "int8", "int4", "gguf")


def load_transformer(
    model_dir: str | Path,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "cpu",
    *,
    packed: bool | None = None,
    weights: str = "bf16",
) -> Transformer:
    """Build the lean decoder from an HF-style directory, with weights in ``dtype`` on ``device``.

    packed: run the linear layers through dflash2's packed bf16 CPU kernel (:mod:`dflash2.kernels`), whose cost
    stays near one weight read for the 1..16 rows of decoding and verification. None = auto: on for bf16/fp16
    weights on a CPU, off for fp32 (kept on torch's kernels, the reference for exactness tests) and on CUDA.
    weights: one of :data:`WEIGHT_FORMATS`; a quantized format replaces every projection and the head by a
    :class:`~dflash2.kernels.quant_linear.QuantLinear` (CPU only; ``packed`` is then ignored), read from the
    model store's cache of the quantized layers when it holds them (:mod:`dflash2.models.quant_cache`).
    """
    check_weight_format(weights, device)
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = parse_dtype(dtype)
    if weights == "gguf":
        from dflash2.models.gguf_model import load_gguf_transformer  # below this module, imported when needed

        return own_memory(load_gguf_transformer(model_dir, config, torch_dtype))
    if weights != "bf16":
        from dflash2.models.quant_cache import load_quantized_transformer  # below this module, imported when needed

        model = own_memory(load_quantized_transformer(model_dir, config, torch_dtype, weights))
        move_linear_weights(model)
        return model
    pack = packed if packed is not None else should_pack(device, torch_dtype)
    cache = None
    if pack:  # the store's packed copy of this model, mapped as it is (models/packed_cache.py)
        from dflash2.models.packed_cache import PackedCache

        cache = PackedCache.for_model(model_dir, torch_dtype)
        model = cache.read(config, torch_dtype) if cache is not None else None
        if model is not None:
            return own_memory_if_moved(model)
    # Tensors that the CPU model uses as read get their own memory (a view of the map would pin the file's pages).
    mapped = pack or torch.device(device).type != "cpu"
    state = hf_to_lean_state_dict(read_safetensors(model_dir, mapped=mapped), config)
    model = build_transformer(config, state, torch_dtype, device)
    if pack:
        pack_linear_layers(model)
        own_memory(model)
        if cache is not None:
            cache.write(model)
        move_linear_weights(model)  # onto 2 MiB pages: every decoding step streams them
    return model


def own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Give the parameters and buffers left after the linear layers were packed or quantized their own memory.

    A tensor read from a safetensors file without a dtype or device change is a view of the file's memory map,
    and one such view (the embedding, a norm) keeps the whole mapped file resident: loading the 1.5B target in
    bf16 held 6.2 GB (the file's 3.0 GB next to the packed copy of its weights) instead of 3.7 GB. What is left
    is small (the embedding is the largest: 445 MB), so copying it costs little. Tied weights stay tied (the same
    Parameter is copied once)."""
    for tensor in {id(t): t for t in (*model.parameters(), *model.buffers())}.values():
        tensor.data = tensor.data.clone()
    return model


def own_memory_if_moved(model: torch.nn.Module) -> torch.nn.Module:
    """A model read from a store cache (views of its memory map): its linear weights moved onto huge pages
    (:func:`move_linear_weights`), and then the rest (embedding, norms) copied out of the map, so that no view
    keeps the file's touched pages mapped. Where nothing moved (huge pages off or slow here) the weights keep the
    map, and copying the rest out (the 445 MB embedding of the 1.5B target: ~0.2-0.4 s of a command's start, and
    as much memory again) would free nothing: the embedding then stays a view too, its rows read where they lie."""
    if move_linear_weights(model):
        own_memory(model)
    return model


def check_weight_format(weights: str, device: str | torch.device) -> None:
    """Refuse an unknown weight format, or a quantized one off the CPU (its kernels are CPU kernels)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights != "bf16" and torch.device(device).type != "cpu":
        raise ValueError(f"--weights {weights} runs on the CPU only (device {device!r}); use --weights bf16 on a GPU")


def should_pack(device: str | torch.device, dtype: str | torch.dtype) -> bool:
    """The auto rule of ``load_transformer(packed=None)``: bf16 / fp16 weights on a CPU."""
    return torch.device(device).type == "cpu" and parse_dtype(dtype) in (torch.bfloat16, torch.float16)


def pack_layer_projections(layers) -> None:
    """Swap the q/k/v, output, gate/up and down projections of decoder-shaped ``layers`` for packed ones."""
    from dflash2.kernels import PackedLinear

    replace_layer_projections(layers, PackedLinear.from_linear)


def pack_linear_layers(model: Transformer, *, include_head: bool = True) -> None:
    """Swap every projection (and the head) for a :class:`~dflash2.kernels.PackedLinear` (CPU, inference only).

    Training that backpropagates through the frozen head keeps it as ``nn.Linear`` (``include_head=False``).
    """
    from dflash2.kernels import PackedLinear

    replace_linear_layers(model, PackedLinear.from_linear, include_head=include_head)


def weight_format(model: Transformer) -> str:
    """The weight format of ``model``'s head as loaded: "int8" / "int4" / "gguf" for a quantized model, else "bf16"."""
    from dflash2.kernels.gguf_linear import GgufLinear
    from dflash2.kernels.quant_linear import QuantLinear

    return model.lm_head.weights if isinstance(model.lm_head, (QuantLinear, GgufLinear)) else "bf16"
