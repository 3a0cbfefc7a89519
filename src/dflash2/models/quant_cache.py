"""Cache of quantized (int8 / int4) linear layers in the model store, so that only the first load quantizes.

Layout, beside the converted directory the layers come from (``$DFLASH2_HOME``, default ``~/.cache/dflash2``)::

    models/<name>/<dtype>/                   converted directory (the source)
    models/<name>/<dtype>-<weights>/         quantized.safetensors: its layers quantized to int8 / int4
    models/<name>/<dtype>-as-<load>-<weights>/  the same, loaded in another dtype than the directory's

``quantized.safetensors`` holds, for every projection and the head (``layers.3.attn.wqkv``, ``lm_head``, ...),
``<layer>.weight`` / ``<layer>.scale`` / ``<layer>.bias`` exactly as the AVX2 kernel consumes them (int8 [P, K, 16]
or int4 uint8 [P, K/2, 16] panels, fp32 scales, fp32 bias), and in its metadata the cache version, the weight
format, the panel and group sizes, a hash of the quantizer's code (:func:`layout_tag`: editing how weights are
quantized or packed invalidates every cache), the load dtype and the identity of the source (name, size and mtime
of its config.json and *.safetensors).  It is written to a temporary file and renamed into place, so an
interrupted write leaves no cache.  A cache whose metadata or tensors do not match, or that cannot be read, is
reported by one warning and rebuilt.

Only directories inside the store are cached (registry models and converted .gguf files); a model directory of
the user's is quantized at every load and nothing is written.  ``DFLASH2_QUANT_CACHE=off`` disables the cache.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash2 import platform
from dflash2.atomic import durable_file
from dflash2.kernels import quant_linear as ql
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.state_dict import (
    DTYPES,
    build_transformer,
    hf_to_lean_state_dict,
    is_hf_linear,
    quantize_linear_layers,
    read_safetensors,
    replace_linear_layers,
)
from dflash2.models.store import home
from dflash2.models.validate import ModelFileError, check_safetensors

__all__ = ["CACHE_FILE", "CACHE_VERSION", "QuantCache", "cache_enabled", "layout_tag", "load_quantized_transformer"]

CACHE_VERSION = "1"  # of this file's layout (tensor names, metadata keys)
CACHE_FILE = "quantized.safetensors"
_ENV = "DFLASH2_QUANT_CACHE"
_PROGRESS_BYTES = 64 << 20  # progress bars from this many bytes of quantized weights (real models, not tests)
_SAFETENSORS_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
                       torch.float16: "F16"}


class QuantCacheError(ValueError):
    """A cache that must not be used: why, in words."""


@dataclass(frozen=True)
class QuantCache:
    """Where the quantized layers of one (source directory, load dtype, weight format) live and what they must match."""

    path: Path  # .../quantized.safetensors
    metadata: dict[str, str]  # what the file's metadata must hold, exactly

    @classmethod
    def for_model(cls, model_dir: Path, dtype: torch.dtype, weights: str) -> "QuantCache | None":
        """The cache of ``model_dir`` loaded in ``dtype`` as ``weights``; None when disabled or outside the store."""
        if not cache_enabled():
            return None
        source = store_source(model_dir)
        if source is None:
            return None
        source_dtype = source.name
        load = _dtype_name(dtype)
        folder = f"{source_dtype}-{weights}" if load == source_dtype else f"{source_dtype}-as-{load}-{weights}"
        metadata = {
            "dflash2_quant_cache": CACHE_VERSION,
            "format": weights,
            "panel": str(ql.PANEL),
            "group_size": str(ql.GROUP) if weights == "int4" else "0",
            "layout": layout_tag(),
            "dtype": load,
            "source": source_identity(source),
        }
        return cls(source.parent / folder / CACHE_FILE, metadata)

    def read(self, model: Transformer) -> dict[str, ql.QuantLinear] | None:
        """The cached layers for ``model``'s linear layers (still on the meta device), or None when there is none.

        A cache that does not match is reported by one warning, and None is returned (the caller rebuilds it).
        """
        if not self.path.is_file():
            return None
        try:
            return self._read(model)
        except (QuantCacheError, ModelFileError, SafetensorError, OSError) as error:
            warnings.warn(f"dflash2: ignoring the quantized-weight cache {self.path} ({error}); quantizing again "
                          "and rewriting it", RuntimeWarning, stacklevel=3)
            return None

    def _read(self, model: Transformer) -> dict[str, ql.QuantLinear]:
        backend = ql.default_quant_backend(self.metadata["format"])
        expected = _linear_layers(model)
        check_safetensors(self.path)  # offsets and sizes against the file before it is mapped
        with safe_open(str(self.path), framework="pt") as handle:
            mismatch = metadata_mismatch(handle.metadata() or {}, self.metadata)
            if mismatch:
                raise QuantCacheError(mismatch)
            names = set(handle.keys())
            wanted = {f"{layer}.{part}" for layer, linear in expected.items()
                      for part in (("weight", "scale", "bias") if linear.bias is not None else ("weight", "scale"))}
            if names != wanted:
                odd = sorted(names ^ wanted)
                raise QuantCacheError(f"{len(odd)} tensors missing or unexpected, e.g. {odd[0]}")
            bar = _bar(len(expected), "reading quantized layers", _size(self.path))
            layers = {}
            for layer, linear in expected.items():
                tensors = {part: handle.get_tensor(f"{layer}.{part}") for part in ("weight", "scale", "bias")
                           if f"{layer}.{part}" in names}
                layers[layer] = _layer(self.metadata["format"], linear, tensors, backend)
                bar.update()
            bar.close()
        return layers

    def write(self, model: Transformer) -> None:
        """Write ``model``'s quantized layers atomically (a temporary file renamed into place)."""
        tensors = {}
        for layer, module in _quantized_layers(model).items():
            weight, scale = _packed(module)
            tensors[f"{layer}.weight"], tensors[f"{layer}.scale"] = weight, scale
            if module.bias_data is not None:
                tensors[f"{layer}.bias"] = module.bias_data
        write_cache_file(self.path, tensors, self.metadata)


def load_quantized_transformer(model_dir: Path, config: ModelConfig, dtype: torch.dtype, weights: str) -> Transformer:
    """The decoder of ``model_dir`` with every projection and the head quantized to ``weights`` (CPU).

    Reads the cached layers when the store holds a matching cache (the source's projections are then not even
    read), else quantizes them and writes the cache (see the module docstring for where caching applies).
    """
    cache = QuantCache.for_model(model_dir, dtype, weights)
    if cache is not None and cache.path.is_file():
        model = build_transformer(config, hf_to_lean_state_dict(
            read_safetensors(model_dir, keep=lambda name: not is_hf_linear(name)), config, linear=False),
            dtype, "cpu", linear=False)
        layers = cache.read(model)
        if layers is not None:
            _install(model, layers)
            return model
    model = build_transformer(config, hf_to_lean_state_dict(read_safetensors(model_dir), config), dtype, "cpu")
    quantize_linear_layers(model, weights, progress=_linear_bytes(model) >= _PROGRESS_BYTES)
    if cache is not None:
        cache.write(model)
    return model


def cache_enabled() -> bool:
    """``$DFLASH2_QUANT_CACHE`` (parsed once, :func:`dflash2.platform.settings`): on (default, also "1" / "true" /
    "yes") or off ("0" / "false" / "no")."""
    profile = platform.settings()
    profile.check(_ENV)
    return profile.quant_cache


@functools.lru_cache(maxsize=None)
def layout_tag() -> str:
    """A hash of the code that decides the cached tensors: quantization, packing, bias handling and the sizes."""
    parts = [inspect.getsource(f) for f in (ql.quantize_int8, ql.quantize_int4, ql.pack_int8, ql.pack_int4,
                                            ql._pack_int8, ql.QuantLinear.from_weight)]
    parts += [f"PANEL={ql.PANEL}", f"GROUP={ql.GROUP}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def source_identity(model_dir: Path) -> str:
    """Name, size and mtime (ns) of ``model_dir``'s config.json and *.safetensors, as one JSON string."""
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    return json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files], separators=(",", ":"))


def store_source(model_dir: Path) -> Path | None:
    """``model_dir`` resolved when it is a converted directory of the store (``models/<name>/<dtype>``), the only
    ones whose derived forms are cached beside them; else None."""
    source = model_dir.resolve()
    try:
        parts = source.relative_to((home() / "models").resolve()).parts
    except ValueError:
        return None
    return source if len(parts) == 2 else None


def metadata_mismatch(found: dict[str, str], expected: dict[str, str]) -> str:
    """The first key whose value in a cache file's metadata differs from what it must be, in words ("" if none)."""
    key = next((key for key in sorted(expected) if found.get(key) != expected[key]), None)
    return "" if key is None else f"{key} is {found.get(key)!r}, expected {expected[key]!r}"


def write_cache_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors cache file atomically: a temporary file beside it, synced, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with durable_file(path) as out:
        _write_safetensors(out, tensors, metadata, f"writing {path.parent.name} cache")


# ----------------------------------------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _linear_layers(model: Transformer) -> dict[str, torch.nn.Module]:
    """{qualified name: module} of the layers :func:`replace_linear_layers` replaces, in its order."""
    names = {id(module): name for name, module in model.named_modules()}
    found: dict[str, torch.nn.Module] = {}

    def record(module):
        found[names[id(module)]] = module
        return module

    replace_linear_layers(model, record)  # replaces each layer by itself: only records the names
    return found


def _quantized_layers(model: Transformer) -> dict[str, ql.QuantLinear]:
    layers = _linear_layers(model)
    odd = [name for name, module in layers.items() if not isinstance(module, ql.QuantLinear)]
    if odd:
        raise TypeError(f"not a quantized layer: {odd[0]}")
    return layers


def _install(model: Transformer, layers: dict[str, ql.QuantLinear]) -> None:
    names = {id(module): name for name, module in model.named_modules()}
    replace_linear_layers(model, lambda linear: layers[names[id(linear)]])


def _packed(module: ql.QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight and scale in the kernel's (packed) layout, whatever its backend."""
    if module.backend == ql.KERNEL:
        return module.weight_data, module.scale_data
    return ql._PACK[module.weights](*module.quantized())


def _expected_shapes(weights: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    p = -(-n // ql.PANEL)
    if weights == "int8":
        return {"weight": ((p, k, ql.PANEL), torch.int8), "scale": ((n,), torch.float32)}
    return {"weight": ((p, k // 2, ql.PANEL), torch.uint8), "scale": ((p, k // ql.GROUP, ql.PANEL), torch.float32)}


def _layer(weights: str, linear: torch.nn.Module, tensors: dict[str, torch.Tensor], backend: str) -> ql.QuantLinear:
    """A QuantLinear for ``linear`` (meta: only its shape counts) from its cached tensors, checked."""
    n, k = linear.out_features, linear.in_features
    expected = _expected_shapes(weights, n, k)
    if linear.bias is not None:
        expected["bias"] = ((n,), torch.float32)
    for part, (shape, dtype) in expected.items():
        if tuple(tensors[part].shape) != shape or tensors[part].dtype != dtype:
            raise QuantCacheError(f"{part} of a [{n}, {k}] layer is {tensors[part].dtype} "
                                  f"{tuple(tensors[part].shape)}, expected {dtype} {shape}")
    weight, scale = tensors["weight"], tensors["scale"]
    if backend != ql.KERNEL:  # the cache holds the AVX2 kernel's layout
        weight, scale = (ql.unpack_int8(weight, n), scale) if weights == "int8" else ql.unpack_int4(weight, scale, n)
        weight, scale = ql.pack_for_backend(weights, backend, weight, scale)
    return ql.QuantLinear(weights, weight, scale, tensors.get("bias"), k, n, backend)


def _write_safetensors(out, tensors: dict[str, torch.Tensor], metadata: dict[str, str], desc: str) -> None:
    """Stream ``tensors`` into the open binary file ``out`` in the safetensors format, with a progress bar."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    out.write(struct.pack("<Q", len(encoded)) + encoded)
    bar = _bar(offset, desc, offset, unit="B")
    for tensor in tensors.values():
        data = tensor.contiguous().view(torch.uint8).numpy()
        out.write(memoryview(data))
        bar.update(data.size)
    bar.close()


def _bar(total: int, desc: str, size_bytes: int, unit: str = "layer"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=size_bytes < _PROGRESS_BYTES)


def _size(path: Path) -> int:
    return path.stat().st_size


def _linear_bytes(model: Transformer) -> int:
    """Bytes of the (unquantized) weights of the layers to quantize."""
    return sum(m.weight.numel() * m.weight.element_size() for m in _linear_layers(model).values())
