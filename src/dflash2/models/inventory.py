"""What the model store holds, model by model, and removing a model: ``dflash2 models list | show | rm``.

A stored model is everything under ``home()`` that belongs to one name: for a registry model its assembled GGUF
(``gguf/<name>.gguf``) and its folder ``models/<name>/``; for a ``.gguf`` file given by path its folder
``models/gguf-<sha12>/`` (named by the file's sha256, recorded with the file's path in ``dflash2_source.json``).
A model folder holds one converted directory per dtype (``bf16/``, ...) and the caches the loaders write beside
them (quantized layers ``<dtype>-<weights>/``, packed GGUF blocks ``gguf-blocks/``, PARD drafters merged with their
adapter ``<dtype>-pard-<weights>-<adapter>/``, ...); all of it goes with
``remove``. Hashes shown are the recorded ones (the registry's pinned GGUF sha256, each converted directory's
``dflash2_files.json``); ``dflash2 models verify`` re-hashes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash2.models import store
from dflash2.models.chunks import ModelStoreError, _remove_quietly
from dflash2.models.conversion import DTYPE_NAMES

GGUF_PREFIX = "gguf-"  # models/gguf-<sha12>/: conversions of .gguf files given by path
PARD_MARK = "-pard-"  # models/<base>/<dtype>-pard-<weights>-<adapter>/: a merged PARD drafter (drafters/pard_load.py)


@dataclass(frozen=True)
class StoredFile:
    path: str  # relative to the store's root
    size: int  # bytes
    sha256: str | None  # the recorded hash (None: none recorded)


@dataclass(frozen=True)
class StoredPart:
    """One thing stored for a model: its GGUF, a converted directory, or a cache the loaders wrote."""

    path: str  # relative to the store's root
    format: str  # "gguf", "safetensors bf16", "quantized layers (bf16-int8)", "packed GGUF blocks", ...
    size: int  # bytes on disk
    files: tuple[StoredFile, ...] = ()


@dataclass(frozen=True)
class StoredModel:
    name: str
    kind: str  # "registry" | "gguf file" (a conversion of a .gguf given by path)
    description: str
    aliases: tuple[str, ...] = ()
    source: dict = field(default_factory=dict)  # where it came from: packages and sha256, or the .gguf's path
    parts: tuple[StoredPart, ...] = ()

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(part.format for part in self.parts)

    def summary(self) -> dict:
        """One row of ``models list --json``."""
        return {"name": self.name, "kind": self.kind, "aliases": list(self.aliases), "stored": bool(self.parts),
                "size_bytes": self.size, "formats": list(self.formats), "description": self.description}


def stored_models() -> list[StoredModel]:
    """Every registry model (stored or not) and every stored conversion of a .gguf file."""
    models = [_registry_model(spec) for spec in store.REGISTRY.values()]
    root = store.home() / "models"
    if root.is_dir():
        models += [_file_model(path) for path in sorted(root.iterdir())
                   if path.is_dir() and path.name.startswith(GGUF_PREFIX)]
    return models


def find(ref: str) -> StoredModel:
    """The stored model of a registry name or alias, a ``gguf-<sha12>`` name, or a .gguf path (by its hash)."""
    name = store.canonical_name(ref)
    if name is not None:
        return _registry_model(store.REGISTRY[name])
    key = ref.strip()
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        key = GGUF_PREFIX + store._sha256_file(path)[:12]
    folder = store.home() / "models" / key
    if key.startswith(GGUF_PREFIX) and folder.is_dir():
        return _file_model(folder)
    known = [m.name for m in stored_models() if m.parts]
    raise ModelStoreError(f"no stored model {ref!r}; stored: {', '.join(known) or 'none'} (`dflash2 models list`)")


def remove(ref: str) -> tuple[StoredModel, int]:
    """Delete everything stored for ``ref`` (under its pull lock, so no pull of it writes meanwhile); returns the
    model as it was and the bytes freed. A process that has the model loaded keeps its mapped files until it ends."""
    model = find(ref)
    if not model.parts:
        raise ModelStoreError(f"{model.name} is not stored; nothing to remove")
    with store._locked(model.name):
        for part in model.parts:
            _remove_quietly(store.home() / part.path)
        folder = store.home() / "models" / model.name
        if folder.is_dir():  # empty now, or leftovers of an interrupted pull
            _remove_quietly(folder)
    return model, model.size


def store_usage() -> dict[str, int]:
    """Bytes on disk per top-level folder of the store (models, gguf, kernels, wheels, ...)."""
    root = store.home()
    if not root.is_dir():
        return {}
    return {path.name: store._size_on_disk(path) for path in sorted(root.iterdir()) if path.is_dir()}


def _registry_model(spec: store.ModelSpec) -> StoredModel:
    parts = []
    gguf = store.gguf_path(spec.name)
    if gguf.is_file():
        relative = str(gguf.relative_to(store.home()))
        parts.append(StoredPart(relative, "gguf", gguf.stat().st_size, (StoredFile(relative, gguf.stat().st_size,
                                                                                   spec.sha256),)))
    parts += _folder_parts(store.home() / "models" / spec.name)
    source = {"packages": [f"{dist}=={version}" for dist, version, _ in spec.packages], "gguf_sha256": spec.sha256}
    return StoredModel(spec.name, "registry", spec.description, spec.aliases, source, tuple(parts))


def _file_model(folder: Path) -> StoredModel:
    parts = _folder_parts(folder)
    source = next((info for part in parts if (info := store._source_info(store.home() / part.path))), {})
    origin = source.get("gguf_path", "a .gguf file")
    return StoredModel(folder.name, "gguf file", f"converted from {origin}", (),
                       {k: source[k] for k in ("gguf_path", "gguf_sha256") if k in source}, tuple(parts))


def _folder_parts(folder: Path) -> list[StoredPart]:
    if not folder.is_dir():
        return []
    return [_part(path) for path in sorted(folder.iterdir()) if not path.name.startswith(".")]


def _part(path: Path) -> StoredPart:
    relative = path.relative_to(store.home())
    size = store._size_on_disk(path)
    if path.is_file():
        return StoredPart(str(relative), "file", size, (StoredFile(str(relative), size, None),))
    return StoredPart(str(relative), _format(path), size, _files(path))


def _format(directory: Path) -> str:
    name = directory.name
    if name in DTYPE_NAMES:
        return f"safetensors {name}"
    if name == "gguf-blocks":
        return "packed GGUF blocks (--weights gguf)"
    if PARD_MARK in name:  # drafters/pard_load.py: <dtype>-pard-<weights>-<adapter>
        weights, _, adapter = name.split(PARD_MARK, 1)[1].partition("-")
        return f"merged PARD drafter ({weights}, adapter {adapter})"
    if "-packed-" in name:
        return f"packed panels for the {name.split('-packed-')[1]} kernel"
    if "-" in name and name.split("-")[0] in DTYPE_NAMES:
        return f"quantized layers ({name})"
    return name


def _files(directory: Path) -> tuple[StoredFile, ...]:
    """The files of a directory with the hashes its manifest records."""
    try:
        recorded = json.loads((directory / store.FILES_MANIFEST).read_text())
    except (OSError, ValueError):
        recorded = {}
    return tuple(StoredFile(str(path.relative_to(store.home())), path.stat().st_size,
                            (recorded.get(path.name) or {}).get("sha256"))
                 for path in sorted(directory.rglob("*")) if path.is_file() and not path.is_symlink())
