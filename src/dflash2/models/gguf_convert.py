"""Convert a llama.cpp GGUF of the Llama / Qwen2 family or Gemma 3 into a Hugging Face safetensors directory.

The GGUF is read with ``gguf.GGUFReader`` (memory-mapped) and converted one tensor at a time: each tensor
is dequantized to float32 with ``gguf.quants.dequantize``, renamed to its transformers name, un-permuted
where llama.cpp permuted it, cast to the asked dtype and streamed into ``model.safetensors``. Peak memory
is therefore about one float32 tensor (the embedding), not the whole model.

What llama.cpp changes when it writes a Llama GGUF (``convert_hf_to_gguf.py``, ``LlamaModel.permute``):
the rows of ``q_proj`` and ``k_proj`` are reordered from Hugging Face's "rotate half" rope layout
(the two halves of each head: [x_0 .. x_{d/2-1} | x_{d/2} .. x_{d-1}]) to GPT-J's interleaved layout
(x_0, x_{d/2}, x_1, x_{d/2+1}, ...), because llama.cpp's rope for ``llama`` rotates adjacent pairs.
``unpermute_rows`` undoes that. Qwen2 GGUFs use the NEOX rope (rotate half, like Hugging Face), so llama.cpp
leaves their Q/K rows alone and so do we. Gemma 3's own differences: :mod:`dflash2.models.gguf_gemma3`.

The output directory is what ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` expects:
``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer files (made by transformers'
own GGUF tokenizer conversion) and ``dflash2_source.json`` (provenance, written by the caller's ``source``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from dflash2.models import gguf_gemma3
from dflash2.models.conversion import CONVERTER_VERSION, normalize_dtype
from dflash2.models.validate_gguf import validate_gguf

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", gguf_gemma3.ARCHITECTURE)

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_TORCH_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Control tokens llama.cpp treats as end-of-generation when it meets them in a vocabulary
# (llama-vocab.cpp); the generation config lists the ones this vocabulary has, after the GGUF's own eos.
_END_OF_GENERATION_TEXTS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
    "<|end|>", "<EOT>",
)  # fmt: skip
_TOKEN_TYPE_CONTROL = 3

# GGUF tensor name (without the ``.weight`` / ``.bias`` suffix) -> Hugging Face name.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")


class GGUFConvertError(RuntimeError):
    """The GGUF cannot be converted (unsupported architecture, unknown tensor, bad metadata)."""


@dataclass(frozen=True)
class GGUFModelInfo:
    """The hyperparameters and special tokens a GGUF declares (what config.json is made of)."""

    architecture: str  # "llama" | "qwen2" | "gemma3"
    name: str  # general.name, "" when absent
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None unless the GGUF declares a rope scaling type
    max_position_embeddings: int  # the GGUF's context_length
    vocab_size: int  # rows of token_embd
    tie_word_embeddings: bool  # True iff the GGUF has no output.weight
    attention_bias: bool  # q/k/v projections carry a bias
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]  # everything generation stops on: eos first, then other end tokens
    chat_template: str | None
    tokens: tuple[str, ...]  # the vocabulary's token texts (empty when the GGUF has no tokenizer)
    sliding_window: int | None = None  # Gemma 3's local layers' window (its GGUF's attention.sliding_window)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required(reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFConvertError(f"GGUF metadata has no {key!r}")
    return value


def read_gguf_info(reader) -> GGUFModelInfo:
    """Read the model description from an open ``gguf.GGUFReader``."""
    arch = _required(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConvertError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFConvertError("GGUF has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise GGUFConvertError("GGUF carries rope_freqs (llama3-style rope scaling), which is not supported")
    embd_shape = [int(d) for d in tensors["token_embd.weight"].shape]  # GGUF order: [hidden, vocab]
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    n_head = int(_required(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(
        _field(reader, f"{arch}.attention.key_length", None)
        or _field(reader, f"{arch}.rope.dimension_count", None)
        or hidden // n_head
    )
    if "blk.0.attn_q.weight" in tensors:
        q_rows = int(tensors["blk.0.attn_q.weight"].shape[-1])
        if q_rows != n_head * head_dim:
            raise GGUFConvertError(f"attn_q has {q_rows} rows, expected heads x head_dim = {n_head * head_dim}")

    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = float(_required(reader, f"{arch}.rope.scaling.factor"))
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": factor}
        elif scaling_type == "yarn":
            rope_scaling = {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": int(
                    _required(reader, f"{arch}.rope.scaling.original_context_length")
                ),
            }
        else:
            raise GGUFConvertError(f"rope scaling type {scaling_type!r} is not supported")

    tokens = tuple(_field(reader, "tokenizer.ggml.tokens", None) or ())
    token_types = list(_field(reader, "tokenizer.ggml.token_type", None) or ())
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    end_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in end_ids:
            end_ids.append(int(value))
    for token_id, text in enumerate(tokens):
        is_control = token_id < len(token_types) and token_types[token_id] == _TOKEN_TYPE_CONTROL
        if is_control and text in _END_OF_GENERATION_TEXTS and token_id not in end_ids:
            end_ids.append(token_id)

    return GGUFModelInfo(
        architecture=arch,
        name=_field(reader, "general.name", "") or "",
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_required(reader, f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_required(reader, f"{arch}.context_length")),
        vocab_size=embd_shape[-1],
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(eos),
        pad_token_id=_optional_int(_field(reader, "tokenizer.ggml.padding_token_id")),
        eos_token_ids=tuple(end_ids),
        chat_template=_field(reader, "tokenizer.chat_template"),
        tokens=tokens,
        sliding_window=_optional_int(_field(reader, f"{arch}.attention.sliding_window")),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _block_tensors(architecture: str) -> dict[str, str]:
    """GGUF block tensor (without ``.weight``) -> Hugging Face name, for ``architecture``."""
    if architecture == gguf_gemma3.ARCHITECTURE:
        return {**_BLOCK_TENSORS, **gguf_gemma3.BLOCK_TENSORS}
    return _BLOCK_TENSORS


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; raises on unknown names."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    blocks = _block_tensors(architecture)
    if match and match["part"] in blocks:
        return f"model.layers.{match['layer']}.{blocks[match['part']]}.{match['kind']}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise GGUFConvertError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> rotate-half halves).

    weight: [n_head * head_dim, ...] (a projection weight or its bias). llama.cpp wrote
    ``w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    if n_head * 2 * half != rows:
        raise GGUFConvertError(f"cannot un-permute {rows} rows over {n_head} heads")
    per_head = weight.reshape(n_head, half, 2, *weight.shape[1:])  # [n_head, head_dim/2, 2, ...]
    return per_head.swapaxes(1, 2).reshape(weight.shape)  # [n_head * head_dim, ...]


def build_config(info: GGUFModelInfo, dtype: str) -> dict[str, Any]:
    """config.json for ``info``, with weights stored in ``dtype`` ('bf16' | 'fp16' | 'fp32')."""
    torch_dtype = _TORCH_DTYPE_NAME[DTYPES[normalize_dtype(dtype)]]
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if info.architecture == "qwen2" else "LlamaForCausalLM"],
        "model_type": info.architecture,
        "hidden_act": "silu",
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_hidden_layers,
        "num_attention_heads": info.num_attention_heads,
        "num_key_value_heads": info.num_key_value_heads,
        "head_dim": info.head_dim,
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "rope_scaling": info.rope_scaling,
        "max_position_embeddings": info.max_position_embeddings,
        "vocab_size": info.vocab_size,
        "tie_word_embeddings": info.tie_word_embeddings,
        "bos_token_id": info.bos_token_id,
        "eos_token_id": info.eos_token_id,
        "pad_token_id": info.pad_token_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if info.architecture == gguf_gemma3.ARCHITECTURE:
        config.update(gguf_gemma3.config_fields(info.hidden_size, info.num_attention_heads, info.head_dim,
                                                info.num_hidden_layers, info.sliding_window))
    elif info.architecture == "llama":
        config["attention_bias"] = info.attention_bias
        config["mlp_bias"] = False
    else:  # qwen2: q/k/v always carry a bias; no sliding window in these models
        if not info.attention_bias:
            raise GGUFConvertError("qwen2 GGUF without attn_q.bias: not a Qwen2 checkpoint transformers can load")
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = info.num_hidden_layers
    return config


def build_generation_config(info: GGUFModelInfo) -> dict[str, Any]:
    eos: int | list[int] | None = list(info.eos_token_ids) or info.eos_token_id
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    generation = {"bos_token_id": info.bos_token_id, "eos_token_id": eos, "pad_token_id": info.pad_token_id}
    return {k: v for k, v in generation.items() if v is not None}


def _tensor_plan(reader, info: GGUFModelInfo) -> list[tuple[Any, str, tuple[int, ...]]]:
    """(gguf tensor, hf name, hf shape) for every tensor, checked before anything is written."""
    plan = []
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, info.architecture)
        shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))  # GGUF lists dims fastest-first
        plan.append((tensor, name, shape))
    names = {name for _, name, _ in plan}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(info.num_hidden_layers):
        for part in _block_tensors(info.architecture).values():
            expected.add(f"model.layers.{layer}.{part}.weight")
        if info.attention_bias:
            expected.update(f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "qkv")
    if not info.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing = sorted(expected - names)
    if missing:
        raise GGUFConvertError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return plan


def _dequantized(tensor, hf_shape: tuple[int, ...]) -> np.ndarray:
    """The tensor as float32 in Hugging Face shape."""
    from gguf.quants import dequantize

    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(hf_shape)
    if not values.flags.writeable:  # unquantized tensors come back as views of the read-only memory map
        values = values.copy()
    return values


def _hf_weight(tensor, hf_name: str, hf_shape: tuple[int, ...], info: GGUFModelInfo) -> np.ndarray:
    values = _dequantized(tensor, hf_shape)
    if info.architecture == gguf_gemma3.ARCHITECTURE and gguf_gemma3.is_norm(hf_name):
        values = gguf_gemma3.hf_norm_weight(values)
    if info.architecture == "llama":
        if ".self_attn.q_proj." in hf_name:
            values = unpermute_rows(values, info.num_attention_heads)
        elif ".self_attn.k_proj." in hf_name:
            values = unpermute_rows(values, info.num_key_value_heads)
    return values


def write_safetensors_streaming(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    tensors: Iterable[torch.Tensor],
    dtype: torch.dtype,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file whose header is known up front, one tensor at a time.

    entries: (name, shape) in file order; ``tensors`` yields them in the same order, already in ``dtype``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        written = 0
        for (name, shape), tensor in zip(entries, tensors, strict=True):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise GGUFConvertError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
            data = tensor.contiguous().view(torch.uint8).numpy() if tensor.numel() else b""
            out.write(memoryview(data))
            written += tensor.numel() * itemsize
        if written != offset:
            raise GGUFConvertError(f"wrote {written} tensor bytes, planned {offset}")
        out.flush()
        os.fsync(out.fileno())


def convert_weights(reader, info: GGUFModelInfo, path: Path, dtype: str, progress: bool = True) -> None:
    """Dequantize, rename and write every tensor of ``reader`` into ``path`` (a .safetensors file)."""
    from tqdm.auto import tqdm

    torch_dtype = DTYPES[normalize_dtype(dtype)]
    plan = _tensor_plan(reader, info)

    def tensors():
        bar = tqdm(plan, desc=f"converting to {dtype}", unit="tensor", disable=not progress, leave=False)
        for tensor, name, shape in bar:
            values = _hf_weight(tensor, name, shape, info)  # [hf shape] float32
            yield torch.from_numpy(values).to(torch_dtype)

    write_safetensors_streaming(path, [(name, shape) for _, name, shape in plan], tensors(), torch_dtype)


def write_tokenizer(gguf_path: Path, out_dir: Path, info: GGUFModelInfo) -> None:
    """Tokenizer files via transformers' GGUF tokenizer conversion, with the GGUF's chat template and eos."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader logs every metadata key it does not map
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    if info.chat_template:
        tokenizer.chat_template = info.chat_template
    if info.eos_token_id is not None and info.tokens:
        tokenizer.eos_token = info.tokens[info.eos_token_id]
    tokenizer.model_max_length = info.max_position_embeddings
    if tokenizer.pad_token is None and info.pad_token_id is not None and info.tokens:
        tokenizer.pad_token = info.tokens[info.pad_token_id]
    tokenizer.save_pretrained(str(out_dir))

    # Make tokenizer_config.json self-sufficient: readers that ignore chat_template.jinja still find it.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if info.chat_template:
        tokenizer_config["chat_template"] = info.chat_template
    if info.eos_token_id is not None and info.tokens:
        tokenizer_config["eos_token"] = info.tokens[info.eos_token_id]
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bf16",
    *,
    source: dict[str, Any] | None = None,
    tokenizer: bool = True,
    progress: bool = True,
) -> Path:
    """Convert ``gguf_path`` into the Hugging Face directory ``out_dir`` (created; must not hold a model).

    Writes into ``out_dir`` directly; callers wanting atomicity pass a temporary directory and rename it.
    ``source`` is stored in ``dflash2_source.json`` together with the dtype and converter version.
    ``tokenizer=False`` skips the tokenizer files (for GGUFs without a vocabulary).
    """
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    dtype = normalize_dtype(dtype)
    validate_gguf(gguf_path)  # every tensor's bytes inside the file and its own, the metadata agreeing: else one line
    reader = GGUFReader(str(gguf_path))
    info = read_gguf_info(reader)
    out_dir.mkdir(parents=True, exist_ok=True)

    convert_weights(reader, info, out_dir / "model.safetensors", dtype, progress=progress)
    _write_json(out_dir / "config.json", build_config(info, dtype))
    _write_json(out_dir / "generation_config.json", build_generation_config(info))
    if tokenizer and info.tokens:
        write_tokenizer(gguf_path, out_dir, info)
    provenance = {
        **(source or {}),
        "gguf_file": gguf_path.name,
        "gguf_name": info.name,
        "architecture": info.architecture,
        "dtype": dtype,
        "converter_version": CONVERTER_VERSION,
    }
    _write_json(out_dir / "dflash2_source.json", provenance)
    return out_dir


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
