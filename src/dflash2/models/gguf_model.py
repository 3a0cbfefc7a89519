"""A decoder whose projections and head run on its GGUF's own blocks: the embedding, norms and biases from the
converted directory, the linear layers from the GGUF (:mod:`dflash2.models.gguf_weights`), packed once and cached in
the store (:mod:`dflash2.models.gguf_cache`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash2.kernels import gguf_linear as gl
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.gguf_cache import GgufCache
from dflash2.models.gguf_weights import gguf_file_of, read_gguf_layers
from dflash2.models.huge_pages import move_linear_weights
from dflash2.models.state_dict import build_transformer, hf_to_lean_state_dict, is_hf_linear, read_safetensors


def _architecture(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text()).get("model_type", "llama")


def load_gguf_transformer(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> Transformer:
    """The decoder of ``model_dir`` with every projection and the head on its GGUF's blocks (CPU)."""
    backend = gl.gguf_backend()
    model = build_transformer(config, hf_to_lean_state_dict(
        read_safetensors(model_dir, keep=lambda name: not is_hf_linear(name)), config, linear=False),
        dtype, "cpu", linear=False)
    gguf = gguf_file_of(model_dir)
    cache = GgufCache.for_model(model_dir, gguf)
    layers = cache.read(config) if cache is not None else None
    if layers is None:
        layers = read_gguf_layers(gguf, config, _architecture(model_dir))
        if cache is not None:
            cache.write(layers)
    for name, (parts, bias) in layers.items():
        _set_module(model, name, gl.GgufLinear(parts, bias, backend))
    # the cache's tensors are views of its memory map: 4 KiB page-cache pages that every decoding step streams
    move_linear_weights(model)
    return model


def _set_module(model: Transformer, name: str, module: torch.nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)
