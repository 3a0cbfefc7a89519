"""A GGUF file's layout read and checked against the file before any byte of it is used.

The converter (``gguf.GGUFReader``) and the packed-block loader trust the header: a tensor whose declared block type
does not fit its bytes reads its neighbour's bytes, a cut file fails deep inside numpy. This parser reads the header
itself with every count bounded by the bytes left, and checks what llama.cpp's ``gguf_init_from_file`` checks:

- magic, version (2 or 3, little-endian), key/value and tensor counts that the remaining bytes can hold;
- every key once, value types known, strings valid UTF-8, ``general.alignment`` a power of two;
- every tensor named once, 1-4 dimensions each in 1 .. 2**31, a known block type whose block size divides the
  first dimension, its offset aligned and equal to the previous tensor's end padded to the alignment (so no two
  overlap and no bytes are left between them), its last byte inside the file, and nothing after the last tensor's
  padding (a last tensor whose type or shape shrank would otherwise leave its bytes unread unnoticed).

Then, for the architectures dflash2 runs (``llama``, ``qwen2``), the metadata must agree with the tensors: the
hyperparameters positive and bounded, the hidden size a multiple of the head count (unless a key length is given),
the query heads a multiple of the key/value heads, every layer's tensors present with the shapes the layer count,
widths and heads give, no layer past the layer count, a vocabulary no larger than the embedding and special token
ids inside it. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2.models.validate import ModelFileError

__all__ = ["ArrayValue", "GGUFLayout", "GGUFTensor", "check_gguf_model", "read_gguf_layout", "validate_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM = 1 << 31  # elements along one dimension
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_STRING = 64 << 20  # bytes of one string (chat templates are ~10 KB; token texts a few bytes)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> (struct format, bytes); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY = 8, 9
INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
FLOAT_TYPES = (6, 12)


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array: its element type and length (elements are skipped, not kept: 150K token texts)."""

    element_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first, [K, N] for a matrix
    type_id: int
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    path: Path
    version: int
    metadata: dict[str, tuple[int, Any]]  # key -> (value type, scalar | str | ArrayValue)
    tensors: dict[str, GGUFTensor]  # in file order
    alignment: int
    data_start: int
    file_size: int


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """{type id: (name, elements per block, bytes per block)} of every block type gguf-py knows."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


class _Cursor:
    """Bounded little-endian reads from the file's bytes; running out is a ModelFileError saying what was read."""

    def __init__(self, path: Path, data: bytes | mmap.mmap) -> None:
        self.path, self.data, self.pos, self.size = path, data, 0, len(data)

    def fail(self, what: str, where: str | None = None) -> ModelFileError:
        return ModelFileError(self.path, what, where)

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"the header ends inside {what} (byte {self.pos} of {self.size}): truncated or damaged")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, value_type: int, what: str):
        fmt, size = _SCALARS[value_type]
        return struct.unpack_from(fmt, self.data, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str, *, keep: bool = True) -> str:
        length = self.u64(f"the length of {what}")
        if length > min(MAX_STRING, self.size - self.pos):
            raise self.fail(f"{what} claims {length} bytes, more than the file has left", None)
        start = self.take(length, what)
        if not keep:
            return ""
        try:
            return bytes(self.data[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def count(self, what: str, limit: int, min_item_bytes: int) -> int:
        value = self.u64(what)
        room = (self.size - self.pos) // max(min_item_bytes, 1)
        if value > min(limit, room):
            raise self.fail(f"{what} is {value}: more than the file can hold (at most {min(limit, room)}): truncated "
                            "or damaged")
        return value


def _value(cur: _Cursor, value_type: int, key: str, *, in_array: bool = False):
    if value_type in _SCALARS:
        return cur.scalar(value_type, f"the value of {key}")
    if value_type == STRING:
        return cur.string(f"the value of {key}", keep=not in_array)
    if value_type == ARRAY and not in_array:
        element_type = cur.u32(f"the element type of {key}")
        if element_type not in _SCALARS and element_type != STRING:
            raise cur.fail(f"array element type {element_type} is not a GGUF value type", key)
        count = cur.count(f"the length of {key}", 1 << 40, _SCALARS.get(element_type, ("", 8))[1])
        if element_type in _SCALARS:
            cur.take(count * _SCALARS[element_type][1], f"the elements of {key}")
        else:
            cur.pos = _skip_strings(cur, count, key)
        return ArrayValue(element_type, count)
    raise cur.fail(f"value type {value_type} is not a GGUF value type", key)


def _skip_strings(cur: _Cursor, count: int, key: str) -> int:
    """The position after ``count`` strings from the cursor's, each valid UTF-8 (one tight loop: a vocabulary has 150K
    of them)."""
    unpack, data, pos, size = struct.Struct("<Q").unpack_from, cur.data, cur.pos, cur.size
    for _ in range(count):
        if pos + 8 > size:
            pos = size + 1
            break
        length = unpack(data, pos)[0]
        try:  # token texts reach the tokenizer, which would fail on invalid UTF-8 far from here
            bytes(data[pos + 8:pos + 8 + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise cur.fail(f"element {_} is not valid UTF-8", key) from None
        pos += 8 + length
    if pos > size:
        raise cur.fail(f"the elements of {key} run past the end of the file: truncated or damaged")
    return pos


def _metadata(cur: _Cursor, count: int) -> dict[str, tuple[int, Any]]:
    metadata: dict[str, tuple[int, Any]] = {}
    for index in range(count):
        key = cur.string(f"the name of metadata key {index}")
        if key in metadata:
            raise cur.fail("appears twice in the metadata", key)
        value_type = cur.u32(f"the value type of {key}")
        metadata[key] = (value_type, _value(cur, value_type, key))
    return metadata


def _alignment(cur: _Cursor, metadata: dict[str, tuple[int, Any]]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    value_type, value = metadata["general.alignment"]
    if value_type != 4 or value <= 0 or value & (value - 1):
        raise cur.fail(f"must be a power of two (uint32), got {value!r}", "general.alignment")
    return value


def _tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos, names = [], set()
    for index in range(count):
        name = cur.string(f"the name of tensor {index}")
        if name in names:
            raise cur.fail("is declared twice", f"tensor {name}")
        names.add(name)
        n_dims = cur.u32(f"the rank of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", f"tensor {name}")
        shape = tuple(cur.u64(f"the shape of tensor {name}") for _ in range(n_dims))
        if any(not 1 <= d <= MAX_DIM for d in shape):
            raise cur.fail(f"has shape {list(shape)}: every dimension must be 1 .. {MAX_DIM}", f"tensor {name}")
        type_id = cur.u32(f"the type of tensor {name}")
        offset = cur.u64(f"the offset of tensor {name}")
        infos.append((name, shape, type_id, offset))
    return infos


def _place(cur: _Cursor, infos, alignment: int, data_start: int) -> dict[str, GGUFTensor]:
    """Each tensor's size from its type and shape, at the offset the previous one's padded end gives."""
    sizes = _quant_sizes()
    tensors: dict[str, GGUFTensor] = {}
    expected, previous = 0, None
    for name, shape, type_id, offset in infos:
        where = f"tensor {name}"
        if type_id not in sizes:
            raise cur.fail(f"has block type {type_id}, which is not a GGML type", where)
        type_name, block, block_bytes = sizes[type_id]
        if shape[0] % block:
            raise cur.fail(f"is {type_name} (blocks of {block}) but its rows have {shape[0]} elements", where)
        elements = 1
        for d in shape:
            elements *= d
        nbytes = elements // block * block_bytes
        if offset % alignment:
            raise cur.fail(f"starts at offset {offset}, not a multiple of the alignment {alignment}", where)
        if offset != expected:
            before = f"{previous.name} before it ({previous.type_name} {list(previous.shape)}) ends" if previous else \
                "the data section starts"
            raise cur.fail(f"starts at offset {offset} but {before} at {expected}: a type, shape or offset is damaged",
                           where)
        end = data_start + offset + nbytes
        if end > cur.size:
            raise cur.fail(f"{type_name} {list(shape)} needs bytes {data_start + offset}..{end} but the file has "
                           f"{cur.size}: truncated or damaged", where)
        tensors[name] = previous = GGUFTensor(name, shape, type_id, type_name, offset, nbytes)
        expected = offset + nbytes + (-nbytes % alignment)
    if previous is not None and cur.size > data_start + expected:  # writers pad the last tensor, nothing after it
        raise cur.fail(f"{cur.size - data_start - expected} bytes follow its padded end, where the file should end: "
                       "its type or shape is damaged", f"tensor {previous.name} (the last)")
    return tensors


def read_gguf_layout(path: str | Path) -> GGUFLayout:
    """The checked layout of the GGUF at ``path``; a ModelFileError naming the key or tensor otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as stream:
            size = stream.seek(0, 2)
            if size == 0:
                raise ModelFileError(path, "the file is empty")
            with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(_Cursor(path, data))
    except OSError as error:
        raise ModelFileError(path, f"cannot be read: {error.strerror or error}") from None


def _parse(cur: _Cursor) -> GGUFLayout:
    magic = bytes(cur.data[0:4])
    if magic != MAGIC:
        raise cur.fail(f"is not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    cur.take(4, "the magic")
    version = cur.u32("the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in VERSIONS:
            raise cur.fail("is a big-endian GGUF, which dflash2 does not read")
        raise cur.fail(f"has GGUF version {version}; dflash2 reads versions {', '.join(map(str, VERSIONS))}")
    n_tensors = cur.count("the tensor count", MAX_TENSORS, 24)  # name length, rank, one dim, type, offset
    n_keys = cur.count("the metadata key count", MAX_KEYS, 12)  # key length, value type
    metadata = _metadata(cur, n_keys)
    alignment = _alignment(cur, metadata)
    infos = _tensor_infos(cur, n_tensors)
    data_start = cur.pos + (-cur.pos % alignment)
    tensors = _place(cur, infos, alignment, data_start)
    return GGUFLayout(cur.path, version, metadata, tensors, alignment, data_start, cur.size)


# ------------------------------------------------------------------------------------------------ the model


MODEL_ARCHITECTURES = ("llama", "qwen2")
_LIMITS = {"block_count": 1 << 12, "embedding_length": 1 << 17, "feed_forward_length": 1 << 19,
           "attention.head_count": 1 << 12, "attention.head_count_kv": 1 << 12, "attention.key_length": 1 << 12,
           "context_length": 1 << 24}
_TOKEN_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
               "tokenizer.ggml.eom_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id")


class _Model:
    """The metadata of one GGUF read with its errors naming the file and key."""

    def __init__(self, layout: GGUFLayout) -> None:
        self.layout = layout

    def fail(self, what: str, where: str | None = None) -> ModelFileError:
        return ModelFileError(self.layout.path, what, where)

    def integer(self, key: str, *, required: bool = True, limit: int = 1 << 31) -> int | None:
        if key not in self.layout.metadata:
            if required:
                raise self.fail("is missing from the metadata", key)
            return None
        value_type, value = self.layout.metadata[key]
        if value_type not in INTEGER_TYPES:
            raise self.fail(f"must be an integer (GGUF value type {value_type})", key)
        if not 1 <= value <= limit:
            raise self.fail(f"is {value}; it must be 1 .. {limit}", key)
        return value

    def shape(self, name: str, expected: tuple[int, ...], *, required: bool = True) -> None:
        tensor = self.layout.tensors.get(name)
        if tensor is None:
            if required:
                raise self.fail("is missing", f"tensor {name}")
            return
        if tensor.shape != expected:
            raise self.fail(f"has shape {list(tensor.shape)}; the metadata gives {list(expected)}", f"tensor {name}")


def check_gguf_model(layout: GGUFLayout) -> None:
    """The metadata of a llama / qwen2 GGUF agrees with its tensors (other architectures: nothing more checked,
    the converter refuses them by name)."""
    model = _Model(layout)
    value_type, arch = layout.metadata.get("general.architecture", (None, None))
    if value_type != STRING:
        raise model.fail("is missing or not a string", "general.architecture")
    if arch not in MODEL_ARCHITECTURES:
        return
    hp = {key: model.integer(f"{arch}.{key}", required=key not in ("attention.head_count_kv",
                                                                   "attention.key_length"), limit=limit)
          for key, limit in _LIMITS.items()}
    hidden, heads = hp["embedding_length"], hp["attention.head_count"]
    kv_heads = hp["attention.head_count_kv"] or heads
    if heads % kv_heads:
        raise model.fail(f"{heads} query heads do not divide into {kv_heads} key/value groups",
                         f"{arch}.attention.head_count_kv")
    head_dim = hp["attention.key_length"]
    if head_dim is None:
        if hidden % heads:
            raise model.fail(f"the hidden size {hidden} does not divide by the head count {heads} (and no "
                             "attention.key_length is given)", f"{arch}.attention.head_count")
        head_dim = hidden // heads
    vocab = _check_vocabulary(model, hidden)
    _check_layers(model, hp["block_count"], hidden, heads * head_dim, kv_heads * head_dim, hp["feed_forward_length"])
    model.shape("output_norm.weight", (hidden,))
    model.shape("output.weight", (hidden, vocab), required=False)


def _check_vocabulary(model: _Model, hidden: int) -> int:
    embedding = model.layout.tensors.get("token_embd.weight")
    if embedding is None:
        raise model.fail("is missing", "tensor token_embd.weight")
    if len(embedding.shape) != 2 or embedding.shape[0] != hidden:
        raise model.fail(f"has shape {list(embedding.shape)}; the metadata gives [{hidden}, vocabulary]",
                         "tensor token_embd.weight")
    vocab = embedding.shape[1]
    tokens = model.layout.metadata.get("tokenizer.ggml.tokens")
    count = vocab
    if tokens is not None:
        if not isinstance(tokens[1], ArrayValue) or tokens[1].element_type != STRING:
            raise model.fail("must be an array of strings", "tokenizer.ggml.tokens")
        count = tokens[1].count
        if not 1 <= count <= vocab:
            raise model.fail(f"lists {count} tokens for an embedding of {vocab} rows", "tokenizer.ggml.tokens")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            other = model.layout.metadata.get(key)
            if other is not None and (not isinstance(other[1], ArrayValue) or other[1].count != count):
                raise model.fail(f"must list one entry per token ({count})", key)
    for key in _TOKEN_KEYS:
        if key in model.layout.metadata:
            value_type, value = model.layout.metadata[key]
            if value_type not in INTEGER_TYPES or not 0 <= value < count:
                raise model.fail(f"is {value!r}, not a token id below {count}", key)
    return vocab


_LAYER_SHAPES = {  # GGUF order [K, N]: (input width, output width) named by the keys below
    "attn_norm": ("hidden",), "ffn_norm": ("hidden",),
    "attn_q": ("hidden", "q"), "attn_k": ("hidden", "kv"), "attn_v": ("hidden", "kv"), "attn_output": ("q", "hidden"),
    "ffn_gate": ("hidden", "ffn"), "ffn_up": ("hidden", "ffn"), "ffn_down": ("ffn", "hidden"),
}  # fmt: skip


def _check_layers(model: _Model, layers: int, hidden: int, q: int, kv: int, ffn: int) -> None:
    widths = {"hidden": hidden, "q": q, "kv": kv, "ffn": ffn}
    for name in model.layout.tensors:
        if name.startswith("blk."):
            index = name.split(".")[1]
            if not index.isdigit() or int(index) >= layers:
                raise model.fail(f"is past the {layers} layers the metadata declares", f"tensor {name}")
    for i in range(layers):
        for part, dims in _LAYER_SHAPES.items():
            model.shape(f"blk.{i}.{part}.weight", tuple(widths[d] for d in dims))
        for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            model.shape(f"blk.{i}.{part}.bias", (rows,), required=False)


def validate_gguf(path: str | Path) -> GGUFLayout:
    """Read and check the GGUF at ``path``: its layout against the file, its metadata against its tensors."""
    layout = read_gguf_layout(path)
    check_gguf_model(layout)
    return layout
