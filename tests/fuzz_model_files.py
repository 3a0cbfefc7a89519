"""A seeded mutation fuzzer over model files: GGUF, safetensors directories, DFlash drafter checkpoints, PARD adapters.

Each case is one damaged copy of an intact seed file, made by one damage kind, and says whether the damage leaves a
structure that cannot be whole (``must_fail``: a cut inside the data, a block type of another size, a shape or
offset moved, a count or length beyond the file). The property checked by :func:`outcome`: loading the copy ends
in a clean run or in one short error (:class:`ModelFileError` or the converter's own one-line error), never in
another exception, a hang, or a clean run on a ``must_fail`` copy.
"""

from __future__ import annotations

import json
import random
import signal
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

GGUF_KINDS = ("truncate", "flip-metadata", "flip-tensor-info", "block-type", "shape", "offset", "huge-count",
              "hyperparameter")
SAFETENSORS_KINDS = ("truncate", "flip-header", "dtype", "shape", "offsets", "huge-header")
MAX_MESSAGE = 600  # characters of a "short" error


@dataclass(frozen=True)
class Case:
    kind: str  # one of the damage kinds above
    detail: str  # what was changed where, for the failure report
    data: bytes  # the damaged file
    must_fail: bool  # the damage leaves a structure that cannot be whole


# ------------------------------------------------------------------------------------------------ GGUF


@dataclass(frozen=True)
class GGUFMap:
    """Byte positions of the fields of an intact GGUF (read once with gguf-py)."""

    kv: dict[str, list[int]]  # key -> start of each part (key length, key, value type, value parts...), then its end
    tensors: dict[str, list[int]]  # name -> start of (name length, name, rank, dims, type, offset), then the end
    types: dict[str, int]  # name -> block type id
    data_start: int
    data_end: int  # end of the last tensor's bytes
    header_end: int  # end of the tensor infos


def _parts(field) -> list[int]:
    starts = [int(field.offset)]
    for part in field.parts:
        starts.append(starts[-1] + part.nbytes)
    return starts


def map_gguf(path: Path) -> GGUFMap:
    import gguf

    reader = gguf.GGUFReader(str(path))
    kv = {name: _parts(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: _parts(t.field) for t in reader.tensors}
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    header_end = max(parts[-1] for parts in tensors.values())
    return GGUFMap(kv, tensors, types, int(reader.data_offset), data_end, header_end)


def put(data: bytes, pos: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, pos, value)
    return bytes(out)


def _other_type(rng: random.Random, type_id: int) -> int:
    """A block type whose bytes per element differ from ``type_id``'s (or no GGML type at all)."""
    from gguf.constants import GGML_QUANT_SIZES

    sizes = {int(t): size / block for t, (block, size) in GGML_QUANT_SIZES.items()}
    others = [t for t, per in sizes.items() if per != sizes.get(type_id)]
    return rng.choice(others + [4, 5, 31, 99, 0xFFFFFFFF])


def gguf_case(data: bytes, fields: GGUFMap, kind: str, rng: random.Random) -> Case:
    names = sorted(fields.tensors)
    if kind == "truncate":
        cut = rng.randrange(0, fields.data_end)
        return Case(kind, f"cut at byte {cut} of {len(data)}", data[:cut], True)
    if kind in ("flip-metadata", "flip-tensor-info"):
        lo, hi = (0, min(p[0] for p in fields.tensors.values())) if kind == "flip-metadata" else \
            (min(p[0] for p in fields.tensors.values()), fields.header_end)
        out = bytearray(data)
        spots = [rng.randrange(lo, hi) for _ in range(rng.randint(1, 4))]
        for spot in spots:
            out[spot] ^= 1 << rng.randrange(8)
        return Case(kind, f"bits flipped at {spots}", bytes(out), False)
    name = rng.choice(names)
    starts = fields.tensors[name]  # name length, name, rank, dims, type, offset, end
    if kind == "block-type":
        new = _other_type(rng, fields.types[name])
        return Case(kind, f"{name}: type {fields.types[name]} -> {new}", put(data, starts[4], "<I", new), True)
    if kind == "shape":
        rank = (starts[4] - starts[3]) // 8
        axis = rng.randrange(rank)
        old = struct.unpack_from("<Q", data, starts[3] + 8 * axis)[0]
        new = rng.choice([old + 1, old * 2, old + 32, 0, 1 << 40, (1 << 64) - 1, max(old - 32, 1)])
        new = new if new != old else old + 1
        return Case(kind, f"{name}: dim {axis} {old} -> {new}", put(data, starts[3] + 8 * axis, "<Q", new), True)
    if kind == "offset":
        old = struct.unpack_from("<Q", data, starts[5])[0]
        new = rng.choice([old + 1, old + 32, old + 4096, max(old - 32, 0) if old else 32, 1 << 62])
        return Case(kind, f"{name}: offset {old} -> {new}", put(data, starts[5], "<Q", new), True)
    if kind == "huge-count":
        huge = rng.choice([1 << 40, 1 << 62, (1 << 64) - 1, 1 << 33])
        key = rng.choice(sorted(fields.kv))
        spots = [("tensor count", 8, "<Q", huge), ("metadata count", 16, "<Q", huge),
                 (f"name length of {name}", starts[0], "<Q", huge), (f"rank of {name}", starts[2], "<I", 1 << 31),
                 (f"key length of {key}", fields.kv[key][0], "<Q", huge)]
        arrays = sorted(k for k, p in fields.kv.items() if len(p) > 6 and k.startswith("tokenizer.ggml."))
        if arrays:
            array = rng.choice(arrays)
            spots.append((f"length of {array}", fields.kv[array][4], "<Q", huge))
        label, pos, fmt, value = rng.choice(spots)
        return Case(kind, f"{label} -> {value}", put(data, pos, fmt, value), True)
    if kind == "hyperparameter":
        keys = [k for k in sorted(fields.kv) if k.endswith(("block_count", "embedding_length", "head_count",
                                                              "head_count_kv", "feed_forward_length"))]
        key = rng.choice(keys)
        starts_kv = fields.kv[key]
        old = struct.unpack_from("<I", data, starts_kv[3])[0]
        new = rng.choice([old + 1, old - 1, old * 2, 0, 7, 1 << 31])
        new = new if new != old else old + 1
        return Case(kind, f"{key}: {old} -> {new}", put(data, starts_kv[3], "<I", new), True)
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------ safetensors


def _header(data: bytes) -> tuple[dict, int]:
    length = struct.unpack_from("<Q", data, 0)[0]
    return json.loads(data[8:8 + length]), length


def _with_header(data: bytes, header: dict, old_length: int) -> bytes:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + old_length:]


def safetensors_case(data: bytes, kind: str, rng: random.Random) -> Case:
    header, length = _header(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = header[name]
    if kind == "truncate":
        cut = rng.randrange(0, len(data))
        return Case(kind, f"cut at byte {cut} of {len(data)}", data[:cut], True)
    if kind == "flip-header":
        out = bytearray(data)
        spots = [rng.randrange(0, 8 + length) for _ in range(rng.randint(1, 3))]
        for spot in spots:
            out[spot] ^= 1 << rng.randrange(8)
        return Case(kind, f"bits flipped at {spots}", bytes(out), False)
    if kind == "huge-header":
        huge = rng.choice([1 << 40, (1 << 64) - 1, len(data), length + 8])
        return Case(kind, f"header length -> {huge}", put(data, 0, "<Q", huge), huge != length)
    if kind == "dtype":
        sizes = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F64": 8}
        new = rng.choice([d for d, s in sizes.items() if s != sizes.get(entry["dtype"])] + ["Q4", "F4"])
        header[name] = dict(entry, dtype=new)
        return Case(kind, f"{name}: dtype {entry['dtype']} -> {new}", _with_header(data, header, length), True)
    if kind == "shape":
        shape = list(entry["shape"]) or [1]
        axis = rng.randrange(len(shape))
        shape[axis] = rng.choice([shape[axis] + 1, shape[axis] * 2, 0, -1, 1 << 50])
        header[name] = dict(entry, shape=shape)
        return Case(kind, f"{name}: shape {entry['shape']} -> {shape}", _with_header(data, header, length), True)
    if kind == "offsets":
        begin, end = entry["data_offsets"]
        new = rng.choice([[begin + 4, end + 4], [begin, end + 4], [end, begin], [begin - 4, end - 4] if begin else
                          [begin + 8, end], [begin, 1 << 60]])
        header[name] = dict(entry, data_offsets=new)
        return Case(kind, f"{name}: offsets {[begin, end]} -> {new}", _with_header(data, header, length), True)
    raise ValueError(kind)


def config_case(raw: dict, rng: random.Random) -> tuple[str, dict, bool]:
    """A config.json with one size made wrong: (detail, config, must_fail)."""
    key = rng.choice(["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                      "intermediate_size", "vocab_size"])
    new = rng.choice([0, -3, raw[key] + 1, raw[key] * 2, 1 << 40, "64", None])
    return f"config.json {key}: {raw[key]!r} -> {new!r}", dict(raw, **{key: new}), True


# ------------------------------------------------------------------------------------------------ the property


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def outcome(case: Case, load: Callable[[], object], allowed: tuple[type[BaseException], ...], seconds: int = 20
            ) -> str | None:
    """None when ``load()`` keeps the property on ``case``, else why not (one line for the test's report)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        load()
    except Hang:
        return f"{case.kind} ({case.detail}): no answer within {seconds} s"
    except allowed as error:
        message = str(error)
        if "\n" in message or len(message) > MAX_MESSAGE or not message:
            return f"{case.kind} ({case.detail}): error not one short line: {message[:300]!r}"
        return None
    except Exception as error:  # noqa: BLE001 - the property: no other exception escapes
        return f"{case.kind} ({case.detail}): {type(error).__name__}: {str(error)[:300]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if case.must_fail:
        return f"{case.kind} ({case.detail}): loaded without an error, but the file cannot be whole"
    return None


class cases:  # noqa: N801 - reads as a function; a class for len()
    """``count`` cases cycling through ``kinds``, each from its own seeded generator (reproducible one by one), made
    one at a time as they are iterated (each holds a whole damaged copy: 400 copies of SmolLM2 would be 39 GB)."""

    def __init__(self, kinds: tuple[str, ...], count: int, seed: int, make: Callable[[str, random.Random], Case]):
        self.kinds, self.count, self.seed, self.make = kinds, count, seed, make

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Case]:
        for i in range(self.count):
            yield self.make(self.kinds[i % len(self.kinds)], random.Random(self.seed * 100003 + i))


def forward_once(model) -> None:
    """One forward of three ids through a loaded decoder (the bytes are used, not only mapped)."""
    import torch

    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]])).logits.float().sum().item()  # any values: only the run must be clean
