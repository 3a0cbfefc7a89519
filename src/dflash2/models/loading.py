"""Load a Hugging Face style directory (config.json + *.safetensors) into the lean decoder. Never uses pickle."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer, rope_inverse_frequencies

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Weight formats of the linear layers: "bf16" = not quantized (weights in the model dtype, the packed bf16 kernel
# for bf16/fp16 on a CPU); "int8" = weight-only int8 with one fp32 scale per output feature, quantized at the first
# load and cached in the model store (dflash2.models.quant_cache; CPU kernel); "int4" = weight-only 4-bit, one fp32 scale per output and group of 32 inputs (CPU kernel).
# Embeddings and norms stay in the model dtype.
WEIGHT_FORMATS = ("bf16", "int8", "int4")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def read_safetensors(model_dir: Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``model_dir/*.safetensors`` (only the names ``keep`` accepts, when given)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if keep is None or keep(name):
                    tensors[name] = handle.get_tensor(name)
    return tensors


def is_hf_linear(name: str) -> bool:
    """True for the Hugging Face tensors of the projections and the head (what a quantized model replaces)."""
    return name == "lm_head.weight" or "_proj." in name


def hf_to_lean_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig, *, linear: bool = True
                          ) -> dict[str, torch.Tensor]:
    """Rename Hugging Face Llama/Qwen2 tensors to this decoder's names, fusing q/k/v and gate/up.

    linear=False: only the embedding and the norms (the projections and the head come from elsewhere).
    """
    state = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if linear and not config.tie_word_embeddings:
        state["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "attn_norm.weight"] = hf[src + "input_layernorm.weight"]
        state[dst + "ffn_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if not linear:
            continue
        attn = src + "self_attn."
        state[dst + "attn.wqkv.weight"] = torch.cat([hf[attn + f"{p}_proj.weight"] for p in "qkv"])
        if config.qkv_bias:
            state[dst + "attn.wqkv.bias"] = torch.cat([hf[attn + f"{p}_proj.bias"] for p in "qkv"])
        state[dst + "attn.wo.weight"] = hf[attn + "o_proj.weight"]
        state[dst + "ffn.w_gate_up.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        state[dst + "ffn.w_down.weight"] = hf[src + "mlp.down_proj.weight"]
    return state


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
    if weights != "bf16":
        from dflash2.models.quant_cache import load_quantized_transformer

        return load_quantized_transformer(model_dir, config, torch_dtype, weights)
    model = build_transformer(config, hf_to_lean_state_dict(read_safetensors(model_dir), config), torch_dtype, device)
    if packed if packed is not None else should_pack(device, torch_dtype):
        pack_linear_layers(model)
    return model


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
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    return model.eval().requires_grad_(False)


def _is_lean_linear(name: str) -> bool:
    return name.startswith("lm_head.") or name.rsplit(".", 2)[-2] in ("wqkv", "wo", "w_gate_up", "w_down")


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


def replace_layer_projections(layers, make) -> None:
    """Swap the q/k/v, output, gate/up and down projections of decoder-shaped ``layers`` for ``make(linear)``."""
    for layer in layers:
        layer.attn.wqkv = make(layer.attn.wqkv)
        layer.attn.wo = make(layer.attn.wo)
        layer.ffn.w_gate_up = make(layer.ffn.w_gate_up)
        layer.ffn.w_down = make(layer.ffn.w_down)


def pack_linear_layers(model: Transformer, *, include_head: bool = True) -> None:
    """Swap every projection (and the head) for a :class:`~dflash2.kernels.PackedLinear` (CPU, inference only).

    Training that backpropagates through the frozen head keeps it as ``nn.Linear`` (``include_head=False``).
    """
    from dflash2.kernels import PackedLinear

    replace_linear_layers(model, PackedLinear.from_linear, include_head=include_head)


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


def weight_format(model: Transformer) -> str:
    """The weight format of ``model``'s head as loaded: "int8" / "int4" for a quantized model, else "bf16"."""
    from dflash2.kernels.quant_linear import QuantLinear

    return model.lm_head.weights if isinstance(model.lm_head, QuantLinear) else "bf16"
