"""Hugging Face tensors to the lean decoder: read a directory's safetensors, rename (and fuse) them, build the
decoder, swap its linear layers. The pieces :mod:`dflash2.models.loading` and :mod:`dflash2.models.quant_cache`
share, below both (neither is imported here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.validate import check_model_dir

__all__ = ["DTYPES", "build_transformer", "hf_to_lean_state_dict", "is_hf_linear", "parse_dtype", "quantize_linear_layers",
           "read_safetensors", "replace_layer_projections", "replace_linear_layers"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def read_safetensors(model_dir: Path, keep: Callable[[str], bool] | None = None, *, mapped: bool = True
                     ) -> dict[str, torch.Tensor]:
    """Every tensor of ``model_dir/*.safetensors`` (only the names ``keep`` accepts, when given).

    mapped=True: views of the files' memory maps (cheap when the caller copies them anyway: packing, a dtype or
    device change). mapped=False: each tensor read into its own memory. A model used as read keeps a view of the
    map alive, and every page it touches then counts as resident next to what loading copied (the fused q/k/v and
    gate/up): the 1.5B target in fp32 went from 6.9 GB loaded to 9.4 GB after its first forward."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    check_model_dir(model_dir)  # headers against the files, shapes against config.json: one line if not
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not mapped:
            tensors.update(_read_safetensors_file(file, keep))
            continue
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if keep is None or keep(name):
                    tensors[name] = handle.get_tensor(name)
    return tensors


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _read_safetensors_file(file: Path, keep: Callable[[str], bool] | None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file read with plain reads into fresh tensors (no memory map).

    Format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
    data; offsets count from the end of the header."""
    tensors: dict[str, torch.Tensor] = {}
    with open(file, "rb") as stream:
        header_length = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_length))
        data_start = 8 + header_length
        for name, entry in header.items():
            if name == "__metadata__" or (keep is not None and not keep(name)):
                continue
            if entry["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which dflash2 does not read")
            begin, end = entry["data_offsets"]
            tensor = torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
            if tensor.numel() * tensor.element_size() != end - begin:
                raise ValueError(f"{file}: tensor {name} holds {end - begin} bytes, its shape and dtype need "
                                 f"{tensor.numel() * tensor.element_size()}")
            stream.seek(data_start + begin)
            if stream.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != end - begin:
                raise ValueError(f"{file} is truncated (tensor {name})")
            tensors[name] = tensor
    return tensors


def is_hf_linear(name: str) -> bool:
    """True for the Hugging Face tensors of the projections and the head (what a quantized model replaces)."""
    return name == "lm_head.weight" or "_proj." in name


def hf_to_lean_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig, *, linear: bool = True
                          ) -> dict[str, torch.Tensor]:
    """Rename Hugging Face Llama/Qwen2 tensors to this decoder's names, fusing q/k/v and gate/up.

    linear=False: only the embedding and the norms (the projections and the head come from elsewhere).
    ``hf`` is consumed: each tensor is popped as it is taken, so a fused source is freed as soon as it is copied.
    """
    state = {"embed.weight": hf.pop("model.embed_tokens.weight"), "norm.weight": hf.pop("model.norm.weight")}
    if linear and not config.tie_word_embeddings:
        state["lm_head.weight"] = hf.pop("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "attn_norm.weight"] = hf.pop(src + "input_layernorm.weight")
        if config.gemma3 is not None:  # four norms: the post-attention one is not the feed-forward's
            for lean, hf_name in GEMMA3_NORMS.items():
                state[dst + lean] = hf.pop(src + hf_name)
        else:
            state[dst + "ffn_norm.weight"] = hf.pop(src + "post_attention_layernorm.weight")
        if config.qk_norm:  # Qwen3
            state[dst + "attn.q_norm.weight"] = hf.pop(src + "self_attn.q_norm.weight")
            state[dst + "attn.k_norm.weight"] = hf.pop(src + "self_attn.k_norm.weight")
        if not linear:
            continue
        attn = src + "self_attn."
        state[dst + "attn.wqkv.weight"] = torch.cat([hf.pop(attn + f"{p}_proj.weight") for p in "qkv"])
        if config.qkv_bias:
            state[dst + "attn.wqkv.bias"] = torch.cat([hf.pop(attn + f"{p}_proj.bias") for p in "qkv"])
        state[dst + "attn.wo.weight"] = hf.pop(attn + "o_proj.weight")
        state[dst + "ffn.w_gate_up.weight"] = torch.cat([hf.pop(src + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
        state[dst + "ffn.w_down.weight"] = hf.pop(src + "mlp.down_proj.weight")
    return state


# Gemma 3's per-layer norms beyond input_layernorm: lean name -> Hugging Face name
GEMMA3_NORMS = {"post_attn_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
                "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


def build_transformer(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: str | torch.device, *, linear: bool = True) -> Transformer:
    """The decoder over ``state`` (lean names) in ``dtype`` on ``device``, in eval mode without gradients.

    linear=False: ``state`` holds no projections and no head; they stay on the meta device for the caller to
    replace (every other tensor must be in ``state``).
    """
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()}
    with torch.device("meta"):
        model = Transformer(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        missing = [name for name in missing if name != "lm_head.weight"]
    if not linear:
        missing = [name for name in missing if not _is_lean_linear(name)]
    if missing or unexpected:
        raise ValueError(f"state dict does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.reset_rope(device)
    return model.eval().requires_grad_(False)


def _is_lean_linear(name: str) -> bool:
    return name.startswith("lm_head.") or name.rsplit(".", 2)[-2] in ("wqkv", "wo", "w_gate_up", "w_down")


def replace_layer_projections(layers, make) -> None:
    """Swap the q/k/v, output, gate/up and down projections of decoder-shaped ``layers`` for ``make(linear)``."""
    for layer in layers:
        layer.attn.wqkv = make(layer.attn.wqkv)
        layer.attn.wo = make(layer.attn.wo)
        layer.ffn.w_gate_up = make(layer.ffn.w_gate_up)
        layer.ffn.w_down = make(layer.ffn.w_down)


def quantize_linear_layers(model: Transformer, weights: str = "int8", *, progress: bool = False) -> None:
    """Quantize every projection and the head to ``weights`` (weight-only; CPU, inference only)."""
    from tqdm.auto import tqdm

    from dflash2.kernels.quant_linear import QuantLinear

    bar = tqdm(total=4 * len(model.layers) + 1, desc=f"quantizing to {weights}", unit="layer", disable=not progress)

    def make(linear):
        layer = QuantLinear.from_linear(linear, weights)
        bar.update()
        return layer

    replace_linear_layers(model, make)
    bar.close()


def replace_linear_layers(model: Transformer, make, *, include_head: bool = True) -> None:
    """Swap each projection (and the head) for ``make(linear)``."""
    replace_layer_projections(model.layers, make)
    if include_head:
        model.lm_head = make(model.lm_head)
