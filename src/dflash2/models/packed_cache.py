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

:class:`ModelCache` is the file format without the choice of where and for what: any decoder whose linear layers
are ``PackedLinear`` or ``GgufLinear`` (runs of GGUF blocks, their tensors named as in ``models/gguf_cache.py``,
their parameters in the metadata key ``runs``). The merged, quantized PARD drafter is cached with it
(``drafters/pard_load.py``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash2.kernels import amx
from dflash2.kernels import packed_linear as pl
from dflash2.kernels.gguf_linear import GgufLinear, gguf_backend
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer
from dflash2.models.gguf_cache import read_runs, run_tensors
from dflash2.models.prefault import prefault
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

__all__ = ["CACHE_FILE", "CACHE_VERSION", "ModelCache", "PackedCache", "layout_tag"]

CACHE_VERSION = "1"
CACHE_FILE = "packed.safetensors"
STATE_PREFIX = "state."
RUNS = "runs"  # metadata key: {layer: [each run's PackedBlocks.meta()]} of the GgufLinear layers


@dataclass(frozen=True)
class ModelCache:
    """One cached decoder: its file and what the file's metadata must hold (the identity of everything that decided
    its bytes). Reading maps the file; a file that does not match or does not fit is reported by one warning naming
    ``kind`` and read as absent (the caller builds the model again and rewrites it)."""

    path: Path
    metadata: dict[str, str]  # what the file's metadata must hold, exactly
    kind: str = "packed-weight cache"  # how the warning names it

    def read(self, config: ModelConfig, dtype: torch.dtype, out_features: dict[str, int] | None = None
             ) -> Transformer | None:
        """The decoder, its linear layers views of the mapped file; None when there is no usable cache.
        ``out_features``: layers whose output count is not the config's (a drafter's head over a draft
        vocabulary)."""
        if not self.path.is_file():
            return None
        try:
            return self._read(config, dtype, out_features or {})
        except (QuantCacheError, ModelFileError, SafetensorError, OSError, KeyError, TypeError, ValueError) as error:
            warnings.warn(f"dflash2: ignoring the {self.kind} {self.path} ({error}); building it again and "
                          "rewriting it", RuntimeWarning, stacklevel=3)
            return None

    def _read(self, config: ModelConfig, dtype: torch.dtype, out_features: dict[str, int]) -> Transformer:
        check_safetensors(self.path)  # offsets and sizes against the file before it is mapped
        with safe_open(str(self.path), framework="pt") as handle:
            found = handle.metadata() or {}
            mismatch = metadata_mismatch(found, self.metadata)
            if mismatch:
                raise QuantCacheError(mismatch)
            runs = json.loads(found.get(RUNS, "{}"))
            names = set(handle.keys())
            state = {name[len(STATE_PREFIX):]: handle.get_tensor(name) for name in names
                     if name.startswith(STATE_PREFIX)}
            model = build_transformer(config, state, dtype, "cpu", linear=False)
            layers = {}
            for layer, linear in _linear_layers(model).items():
                bias = handle.get_tensor(f"{layer}.bias") if f"{layer}.bias" in names else None
                n = out_features.get(layer, linear.out_features)
                if layer in runs:
                    layers[layer] = _gguf_layer(linear, n, read_runs(handle, names, layer, runs[layer]), bias)
                else:
                    layers[layer] = _layer(linear, n, handle.get_tensor(f"{layer}.weight"), bias, found["backend"])
        _install(model, layers)
        prefault(t for layer in layers.values() for t in _mapped_tensors(layer))  # pages mapped on the other core
        return model

    def write(self, model: Transformer) -> None:
        """Write ``model`` (its linear layers packed or in GGUF blocks) atomically."""
        tensors, runs = {}, {}
        backend = self.metadata.get("backend")
        for layer, module in _linear_layers(model).items():
            if isinstance(module, GgufLinear):
                runs[layer] = [part.meta() for part in module.parts]
                tensors.update(run_tensors(layer, module.parts))
            elif isinstance(module, pl.PackedLinear) and module.backend == backend:
                tensors[f"{layer}.weight"] = module.weight_data
            else:
                raise TypeError(f"{layer} is neither a GgufLinear nor a PackedLinear on {backend}")
            if module.bias_data is not None:
                tensors[f"{layer}.bias"] = module.bias_data
        for name, tensor in model.state_dict().items():  # the rest: embedding, norms (the layers hold no state)
            tensors[STATE_PREFIX + name] = tensor
        metadata = {**self.metadata, RUNS: json.dumps(runs, separators=(",", ":"))} if runs else self.metadata
        write_cache_file(self.path, _unique(tensors), metadata)


@dataclass(frozen=True)
class PackedCache(ModelCache):
    """Where the packed model of one (source directory, load dtype, backend) lives and what it must match."""

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


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors (the embedding as the head's weight in ``state_dict``) written once each name, as own copies."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        out[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return out


def _mapped_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of a layer read from the cache: a PackedLinear's panels and bias, a GgufLinear's runs of blocks."""
    if isinstance(layer, GgufLinear):
        return [t for part in layer.parts for t in part.tensors().values()]
    return [t for t in (layer.weight_data, layer.bias_data) if t is not None]


def _gguf_layer(linear: torch.nn.Module, n: int, parts: list, bias: torch.Tensor | None) -> GgufLinear:
    """A GgufLinear for ``linear`` (meta: only its input width counts) with ``n`` outputs from its cached runs."""
    layer = GgufLinear(parts, bias, gguf_backend())
    if (layer.in_features, layer.out_features) != (linear.in_features, n):
        raise QuantCacheError(f"a [{n}, {linear.in_features}] layer holds blocks of "
                              f"[{layer.out_features}, {layer.in_features}]")
    _check_bias(linear, n, bias)
    return layer


def _layer(linear: torch.nn.Module, n: int, weight: torch.Tensor, bias: torch.Tensor | None,
           backend: str) -> pl.PackedLinear:
    """A PackedLinear for ``linear`` (meta: only its input width counts) with ``n`` outputs from its cached tensors,
    checked."""
    k = linear.in_features
    p = -(-n // pl.PANEL)
    shape = (p, -(-k // amx.STEP), pl.PANEL, amx.STEP) if backend in pl.TILE_LAYOUT else (p, k, pl.PANEL)
    if tuple(weight.shape) != shape or weight.dtype != torch.bfloat16:
        raise QuantCacheError(f"weight of a [{n}, {k}] layer is {weight.dtype} {tuple(weight.shape)}, expected "
                               f"bfloat16 {shape}")
    _check_bias(linear, n, bias)
    return pl.PackedLinear(weight, bias, k, n, backend)


def _check_bias(linear: torch.nn.Module, n: int, bias: torch.Tensor | None) -> None:
    if (linear.bias is not None) != (bias is not None) or (bias is not None and tuple(bias.shape) != (n,)):
        raise QuantCacheError(f"bias of a [{n}, {linear.in_features}] layer does not match")


@functools.lru_cache(maxsize=None)
def layout_tag() -> str:
    """A hash of the code that decides the cached tensors: the packing of each backend's panels."""
    parts = [inspect.getsource(f) for f in (pl.pack_weight, amx.pack_weight_amx, amx._to_tiles,
                                            pl.PackedLinear.from_weight)]
    parts += [f"PANEL={pl.PANEL}", f"STEP={amx.STEP}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
