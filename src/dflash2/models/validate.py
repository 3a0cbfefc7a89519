"""Every model file is checked before any of its bytes is used: one error type, one line.

Users load safetensors and GGUF files from anywhere, and the loaders (numpy, torch, the C++ kernels) trust what a
header says. A damaged file must end in one line naming the file, the tensor or key and what is wrong, never in a
reshape error, a traceback or a model that silently reads its neighbour's bytes.

- :func:`check_safetensors`: the header parses (length inside the file, JSON object of entries), each tensor has a
  known dtype, a shape of 0-8 non-negative dimensions, and ``data_offsets`` whose length is its shape times its dtype
  size; the tensors tile the data section in order (what the safetensors library requires: no overlap, no gap, the
  last one ending at the end of the file).
- :func:`check_model_dir`: a Hugging Face directory: every ``*.safetensors`` as above, ``config.json`` with
  positive, bounded sizes (hidden divisible by heads when no head_dim is given, heads by key/value heads) and
  every tensor the decoder reads present in the shape the config gives.
- GGUF files: :mod:`dflash2.models.validate_gguf` (it raises the same error).

Checks are remembered per (path, size, mtime) in this process, so loading a model twice checks it once.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["ModelFileError", "SAFETENSORS_DTYPE_BYTES", "check_config", "check_model_dir", "check_safetensors",
           "check_shapes"]

MAX_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header
MAX_RANK = 8
MAX_DIM = 1 << 40
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                           "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class ModelFileError(ValueError):
    """A model file that must not be used. ``str()`` is one line: ``<file>: <tensor or key>: <what is wrong>``."""

    def __init__(self, path: str | os.PathLike, what: str, where: str | None = None) -> None:
        self.path, self.what, self.where = Path(path), what, where
        what = what if len(what) <= 400 else what[:400] + " ..."  # (torch's shape errors list every tensor)
        text = f"{path}: {where}: {what}" if where else f"{path}: {what}"
        super().__init__(" ".join(text.split()))  # one line whatever the parts hold


_checked: dict[tuple[str, int, int], dict[str, tuple[str, tuple[int, ...]]]] = {}


def _identity(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def check_safetensors(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of the safetensors file at ``path``, checked against the file (module doc)."""
    path = Path(path)
    try:
        key = _identity(path)
        if key not in _checked:
            _checked[key] = _read_safetensors_header(path, key[1])
    except OSError as error:
        raise ModelFileError(path, f"cannot be read: {error.strerror or error}") from None
    return _checked[key]


def _read_safetensors_header(path: Path, size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open(path, "rb") as stream:
        head = stream.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"has {size} bytes, too few for a safetensors header")
        length = struct.unpack("<Q", head)[0]
        if length > min(MAX_HEADER, size - 8):
            raise ModelFileError(path, f"declares a {length}-byte header but the file has {size} bytes: truncated "
                                       "or not a safetensors file")
        raw = stream.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise ModelFileError(path, f"the header is not valid JSON ({type(error).__name__} at {getattr(error, 'pos', '?')})"
                             ) from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelFileError(path, "must map names to strings", "__metadata__")
    entries = {name: _entry(path, name, entry) for name, entry in header.items()}
    _check_tiling(path, entries, size - 8 - length)
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()}


def _entry(path: Path, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, checked."""
    where = f"tensor {name}"
    if not isinstance(entry, dict):
        raise ModelFileError(path, "is not an object with dtype, shape and data_offsets", where)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BYTES:
        raise ModelFileError(path, f"has dtype {dtype!r}, not a safetensors dtype dflash2 reads", where)
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise ModelFileError(path, f"has shape {shape!r}: expected up to {MAX_RANK} sizes in 0 .. 2**40", where)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise ModelFileError(path, f"has data_offsets {offsets!r}: expected [begin, end] with 0 <= begin <= end",
                             where)
    elements = 1
    for d in shape:
        elements *= d
    need = elements * SAFETENSORS_DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise ModelFileError(path, f"{dtype} {shape} needs {need} bytes but data_offsets give "
                                   f"{offsets[1] - offsets[0]}", where)
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_tiling(path: Path, entries: dict[str, tuple[str, tuple[int, ...], int, int]], data_bytes: int) -> None:
    """The tensors cover the data section in order: each begins where the previous ended, the last at its end."""
    end, previous = 0, None
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != end:
            relation = f"overlaps {previous}" if begin < end else f"leaves bytes {end}..{begin} unused"
            raise ModelFileError(path, f"starts at data byte {begin}: it {relation}", f"tensor {name}")
        end, previous = stop, name
    if end != data_bytes:
        state = "truncated" if end > data_bytes else f"{data_bytes - end} bytes past the last tensor"
        raise ModelFileError(path, f"the tensors need {end} data bytes, the file holds {data_bytes} ({state})")


# ------------------------------------------------------------------------------------------- model directory


_CONFIG_LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
                  "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
                  "head_dim": 1 << 12, "max_position_embeddings": 1 << 24}
_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def check_config(path: str | os.PathLike) -> dict[str, int]:
    """The sizes of the ``config.json`` at ``path`` (see :func:`_config_sizes`): a ModelFileError if one is wrong."""
    return _config_sizes(Path(path))


def _config_sizes(path: Path) -> dict[str, int]:
    """The sizes of ``config.json`` at ``path``, each an integer in 1 .. its bound (optional ones may be absent)."""
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise ModelFileError(path, f"cannot be read: {error.strerror or error}") from None
    except ValueError as error:
        raise ModelFileError(path, f"is not valid JSON ({error.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise ModelFileError(path, "is not a JSON object")
    sizes = {}
    for key, limit in _CONFIG_LIMITS.items():
        value = raw.get(key)
        if value is None and key in _OPTIONAL:
            continue
        if type(value) is not int or not 1 <= value <= limit:
            raise ModelFileError(path, f"is {value!r}; it must be an integer 1 .. {limit}", key)
        sizes[key] = value
    heads = sizes["num_attention_heads"]
    kv = sizes.setdefault("num_key_value_heads", heads)
    if heads % kv:
        raise ModelFileError(path, f"{heads} attention heads do not divide into {kv} key/value groups",
                             "num_key_value_heads")
    if "head_dim" not in sizes:
        if sizes["hidden_size"] % heads:
            raise ModelFileError(path, f"the hidden size {sizes['hidden_size']} does not divide by {heads} heads "
                                       "(and no head_dim is given)", "num_attention_heads")
        sizes["head_dim"] = sizes["hidden_size"] // heads
    sizes["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    sizes["qkv_bias"] = raw.get("model_type") == "qwen2" or bool(raw.get("attention_bias", False))
    sizes["qk_norm"] = raw.get("model_type") == "qwen3"
    sizes["gemma3"] = raw.get("model_type") == "gemma3_text"
    return sizes


def expected_shapes(sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: shape} the decoder reads for these config sizes (q/k/v biases included)."""
    hidden, vocab, ffn = sizes["hidden_size"], sizes["vocab_size"], sizes["intermediate_size"]
    q, kv = sizes["num_attention_heads"] * sizes["head_dim"], sizes["num_key_value_heads"] * sizes["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not sizes["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(sizes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if sizes.get("qk_norm") or sizes.get("gemma3"):  # Qwen3, Gemma 3
            shapes.update({p + "self_attn.q_norm.weight": (sizes["head_dim"],),
                           p + "self_attn.k_norm.weight": (sizes["head_dim"],)})
        if sizes.get("gemma3"):  # its norms before the feed-forward and after either branch
            shapes.update({p + f"{name}_layernorm.weight": (hidden,) for name in ("pre_feedforward",
                                                                                 "post_feedforward")})
    return shapes


def check_shapes(path: Path, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                 optional: tuple[str, ...] = ("_proj.bias",)) -> None:
    """Every name of ``expected`` is in ``found`` with that shape (names ending in ``optional`` may be absent)."""
    for name, shape in expected.items():
        if name not in found:
            if name.endswith(optional):
                continue
            raise ModelFileError(path, "is missing", f"tensor {name}")
        if tuple(found[name]) != tuple(shape):
            raise ModelFileError(path, f"has shape {list(found[name])}; config.json gives {list(shape)}",
                                 f"tensor {name}")


def check_model_dir(model_dir: str | os.PathLike) -> None:
    """A Hugging Face directory of the Llama / Qwen2 family: config.json and every *.safetensors agree (module doc)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        found.update({name: shape for name, (_, shape) in check_safetensors(file).items()})
    if (model_dir / "config.json").is_file() and files:
        sizes = _config_sizes(model_dir / "config.json")
        where = files[0] if len(files) == 1 else model_dir
        check_shapes(where, found, expected_shapes(sizes), optional=() if sizes["qkv_bias"] else ("_proj.bias",))
