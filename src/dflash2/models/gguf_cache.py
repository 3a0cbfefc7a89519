"""The model store's cache of a GGUF's packed blocks (``--weights gguf``), so that only the first load unpacks them.

Layout, beside the converted directories of the model (``$DFLASH2_HOME``, default ``~/.cache/dflash2``)::

    models/<name>/gguf-blocks/packed.safetensors

The file holds, for every projection and the head, the tensors of each run of rows (``layers.3.attn.wqkv.0.weight``,
``...0.scale``, ``...1.sub_scales``, ...) and the fp32 bias (``layers.3.attn.wqkv.bias``) exactly as
:class:`~dflash2.kernels.gguf_linear.GgufLinear` uses them; its metadata records the cache version, a hash of the
code that decodes and packs the blocks (editing it invalidates every cache), the GGUF's identity (name, size,
mtime) and each run's parameters (JSON).  Written to a temporary file renamed into place (an interrupted write
leaves none); one that does not match or cannot be read is reported by a warning and rebuilt.  The packed blocks
do not depend on the load dtype, so one cache serves every dtype.  Only models in the store are cached;
``DFLASH2_QUANT_CACHE=off`` disables this cache too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash2.kernels import gguf_blocks, gguf_packing
from dflash2.kernels.boundary import check_packed_blocks
from dflash2.kernels.gguf_packing import PackedBlocks
from dflash2.models.config import ModelConfig
from dflash2.models.quant_cache import QuantCacheError, cache_enabled, write_cache_file
from dflash2.models.store import home
from dflash2.models.validate import check_safetensors

__all__ = ["CACHE_VERSION", "GgufCache", "layout_tag", "read_runs", "run_tensors"]

CACHE_VERSION = "1"
CACHE_DIR = "gguf-blocks"
CACHE_FILE = "packed.safetensors"
_PARTS = ("weight", "scale", "offset", "sub_scales", "offset_mult")

Layers = dict[str, tuple[list[PackedBlocks], torch.Tensor | None]]


@functools.lru_cache(maxsize=None)
def layout_tag() -> str:
    """A hash of the sources that decide the cached tensors (block decoding, packing, layer mapping)."""
    from dflash2.models import gguf_weights

    sources = [Path(m.__file__).read_bytes() for m in (gguf_blocks, gguf_packing, gguf_weights)]
    return hashlib.sha256(b"\n".join(sources)).hexdigest()[:16]


@dataclass(frozen=True)
class GgufCache:
    """Where the packed blocks of one GGUF live and the metadata the file must hold."""

    path: Path
    metadata: dict[str, str]

    @classmethod
    def for_model(cls, model_dir: Path, gguf: Path) -> "GgufCache | None":
        """The cache for ``model_dir`` (converted from ``gguf``); None when disabled or outside the store."""
        if not cache_enabled():
            return None
        source = model_dir.resolve()
        try:
            source.relative_to((home() / "models").resolve())
        except ValueError:
            return None
        stat = gguf.stat()
        identity = json.dumps([gguf.name, stat.st_size, stat.st_mtime_ns], separators=(",", ":"))
        metadata = {"dflash2_gguf_cache": CACHE_VERSION, "layout": layout_tag(), "gguf": identity}
        return cls(source.parent / CACHE_DIR / CACHE_FILE, metadata)

    def read(self, config: ModelConfig) -> Layers | None:
        """The cached layers, or None (absent, or not matching: then with a warning)."""
        if not self.path.is_file():
            return None
        try:
            return self._read(config)
        except (QuantCacheError, SafetensorError, OSError, KeyError, TypeError, ValueError) as error:
            warnings.warn(f"dflash2: ignoring the gguf block cache {self.path} ({error}); reading the GGUF again "
                          "and rewriting it", RuntimeWarning, stacklevel=3)
            return None

    def _read(self, config: ModelConfig) -> Layers:
        from dflash2.models.gguf_weights import layer_sources

        check_safetensors(self.path)  # offsets and sizes against the file before it is mapped
        with safe_open(str(self.path), framework="pt") as handle:
            found = handle.metadata() or {}
            for key, value in self.metadata.items():
                if found.get(key) != value:
                    raise QuantCacheError(f"{key} is {found.get(key)!r}, expected {value!r}")
            runs = json.loads(found["runs"])
            names = set(handle.keys())
            layers: Layers = {}
            for layer in layer_sources(config):
                parts = read_runs(handle, names, layer, runs[layer])
                bias = handle.get_tensor(f"{layer}.bias") if f"{layer}.bias" in names else None
                layers[layer] = (parts, bias)
        return layers

    def write(self, layers: Layers) -> None:
        """Write ``layers`` atomically (a temporary file renamed into place)."""
        tensors: dict[str, torch.Tensor] = {}
        runs: dict[str, list[dict]] = {}
        for layer, (parts, bias) in layers.items():
            runs[layer] = [part.meta() for part in parts]
            tensors.update(run_tensors(layer, parts))
            if bias is not None:
                tensors[f"{layer}.bias"] = bias
        write_cache_file(self.path, tensors, {**self.metadata, "runs": json.dumps(runs, separators=(",", ":"))})


def run_tensors(layer: str, parts: list[PackedBlocks]) -> dict[str, torch.Tensor]:
    """The tensors of a layer's runs of blocks under their cache names (``<layer>.<run>.<part>``); each run's
    parameters (``PackedBlocks.meta``) go in the file's metadata."""
    return {f"{layer}.{i}.{name}": t for i, part in enumerate(parts) for name, t in part.tensors().items()}


def read_runs(handle, names: set[str], layer: str, metas: list[dict]) -> list[PackedBlocks]:
    """A layer's runs of blocks from an open cache file (``names``: its tensor names), each checked against the
    layout its parameters describe (a KernelInputError: the caller rebuilds, nothing reads past a tensor)."""
    parts = []
    for i, meta in enumerate(metas):
        tensors = {p: handle.get_tensor(f"{layer}.{i}.{p}") for p in _PARTS if f"{layer}.{i}.{p}" in names}
        part = PackedBlocks(weight=tensors["weight"], scale=tensors["scale"], offset=tensors.get("offset"),
                            sub_scales=tensors.get("sub_scales"), offset_mult=tensors.get("offset_mult"), **meta)
        check_packed_blocks(part, f"{layer} run {i}")
        parts.append(part)
    return parts
