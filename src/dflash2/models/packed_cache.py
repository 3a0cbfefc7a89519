"""Cache of a bf16 model as its CPU kernels read it, so that a load maps one file instead of rebuilding the model.

A bf16 load otherwise reads the converted safetensors, fuses q/k/v and gate/up (copies), and packs every projection
into its kernel's panel layout (``PackedLinear.from_weight``): on the 1.5B target most of the CPU time of a
``dflash2 generate`` before the drafter, every command. The first load writes the result here; the next ones
memory-map it (the weights stay in the page cache between commands, shared by every process that loads them)::

    models/<name>/<dtype>/                     converted directory (the source)
    models/<name>/<dtype>-packed-<backend>/    packed.safetensors: every PackedLinear's weight panels and fp32 bias
                                               ("<layer>.weight", "<layer>.bias") and the rest of the decoder's
                                               state ("state.<name>": embedding, norms) in the load dtype

Its metadata records the cache version, the backend (the panel layout differs per backend), a hash of the packing
code (:func:`layout_tag`), the load dtype and the source's identity (:func:`quant_cache.source_identity`); a cache
that does not match is reported by one warning and rewritten. Written to a temporary file renamed into place.
Only directories in the store are cached; ``DFLASH2_QUANT_CACHE=off`` disables this cache too.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash2.kernels import amx
from dflash2.kernels import packed_linear as pl
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.quant_cache import (
    QuantCacheError,
    _dtype_name,
    _install,
    _linear_layers,
    cache_enabled,
    metadata_mismatch,
    source_identity,
    store_source,
    write_cache_file,
)
from dflash2.models.state_dict import build_transformer
from dflash2.models.validate import ModelFileError, check_safetensors

__all__ = ["CACHE_FILE", "CACHE_VERSION", "PackedCache", "layout_tag"]

CACHE_VERSION = "1"
CACHE_FILE = "packed.safetensors"
STATE_PREFIX = "state."


@dataclass(frozen=True)
class PackedCache:
    """Where the packed model of one (source directory, load dtype, backend) lives and what it must match."""

    path: Path  # .../packed.safetensors
    metadata: dict[str, str]  # what the file's metadata must hold, exactly

    @classmethod
    def for_model(cls, model_dir: Path, dtype: torch.dtype) -> "PackedCache | None":
        """The cache of ``model_dir`` loaded in ``dtype`` on this CPU's backend; None when disabled, outside the
        store, or where the kernels do not run (the torch fallback keeps the plain weights)."""
        if not cache_enabled():
            return None
        source = store_source(model_dir)
        if source is None:
            return None
        source_dtype = source.name
        backend = pl.default_backend()
        if backend == pl.TORCH:
            return None
        load = _dtype_name(dtype)
        folder = f"{source_dtype}-packed-{backend}" + ("" if load == source_dtype else f"-as-{load}")
        metadata = {"dflash2_packed_cache": CACHE_VERSION, "backend": backend, "layout": layout_tag(),
                    "dtype": load, "source": source_identity(source)}
        return cls(source.parent / folder / CACHE_FILE, metadata)

    def read(self, config: ModelConfig, dtype: torch.dtype) -> Transformer | None:
        """The packed decoder, its tensors views of the mapped file; None when there is no usable cache (a cache
        that does not match is reported by one warning)."""
        if not self.path.is_file():
            return None
        try:
            return self._read(config, dtype)
        except (QuantCacheError, ModelFileError, SafetensorError, OSError, KeyError) as error:
            warnings.warn(f"dflash2: ignoring the packed-weight cache {self.path} ({error}); packing again and "
                          "rewriting it", RuntimeWarning, stacklevel=3)
            return None

    def _read(self, config: ModelConfig, dtype: torch.dtype) -> Transformer:
        check_safetensors(self.path)  # offsets and sizes against the file before it is mapped
        with safe_open(str(self.path), framework="pt") as handle:
            mismatch = metadata_mismatch(handle.metadata() or {}, self.metadata)
            if mismatch:
                raise QuantCacheError(mismatch)
            names = set(handle.keys())
            state = {name[len(STATE_PREFIX):]: handle.get_tensor(name) for name in names
                     if name.startswith(STATE_PREFIX)}
            model = build_transformer(config, state, dtype, "cpu", linear=False)
            layers = {}
            for layer, linear in _linear_layers(model).items():
                bias = handle.get_tensor(f"{layer}.bias") if f"{layer}.bias" in names else None
                layers[layer] = _layer(linear, handle.get_tensor(f"{layer}.weight"), bias, self.metadata["backend"])
        _install(model, layers)
        return model

    def write(self, model: Transformer) -> None:
        """Write ``model`` (its linear layers packed) atomically."""
        tensors = {}
        for layer, module in _linear_layers(model).items():
            if not isinstance(module, pl.PackedLinear) or module.backend != self.metadata["backend"]:
                raise TypeError(f"{layer} is not a PackedLinear on {self.metadata['backend']}")
            tensors[f"{layer}.weight"] = module.weight_data
            if module.bias_data is not None:
                tensors[f"{layer}.bias"] = module.bias_data
        for name, tensor in model.state_dict().items():
            tensors[STATE_PREFIX + name] = tensor
        write_cache_file(self.path, _unique(tensors), self.metadata)


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors (the embedding as the head's weight in ``state_dict``) written once each name, as own copies."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        out[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return out


def _layer(linear: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> pl.PackedLinear:
    """A PackedLinear for ``linear`` (meta: only its shape counts) from its cached tensors, checked."""
    n, k = linear.out_features, linear.in_features
    p = -(-n // pl.PANEL)
    shape = (p, -(-k // amx.STEP), pl.PANEL, amx.STEP) if backend in pl.TILE_LAYOUT else (p, k, pl.PANEL)
    if tuple(weight.shape) != shape or weight.dtype != torch.bfloat16:
        raise QuantCacheError(f"weight of a [{n}, {k}] layer is {weight.dtype} {tuple(weight.shape)}, expected "
                               f"bfloat16 {shape}")
    if (linear.bias is not None) != (bias is not None) or (bias is not None and tuple(bias.shape) != (n,)):
        raise QuantCacheError(f"bias of a [{n}, {k}] layer does not match")
    return pl.PackedLinear(weight, bias, k, n, backend)


@functools.lru_cache(maxsize=None)
def layout_tag() -> str:
    """A hash of the code that decides the cached tensors: the packing of each backend's panels."""
    parts = [inspect.getsource(f) for f in (pl.pack_weight, amx.pack_weight_amx, amx._to_tiles,
                                            pl.PackedLinear.from_weight)]
    parts += [f"PANEL={pl.PANEL}", f"STEP={amx.STEP}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
