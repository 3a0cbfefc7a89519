"""Building and loading the JIT C++ kernels, below every backend that uses them.

Each kernel module (``packed_linear``, ``amx``, ``dpbf16``, ``quant_linear``, ...) builds its extension with
:func:`jit_load` (``torch.utils.cpp_extension.load``: needs ninja and a C++ compiler) into a directory under
:func:`build_dir` (``$DFLASH2_HOME/kernels/<torch+python tag>``, default ``~/.cache/dflash2``) named by its kind and
a hash of its code, checks it against a reference with its own self-check (once per build and CPU: a passed check
is recorded in the build's directory, :func:`self_check_record`), and loads it once per process with
:func:`ensure_loaded`; :func:`prune_builds` keeps the few most recently used builds of each kind.  Whether a kernel
may be built (:func:`missing_cpu_flags`, :func:`kernels_disabled_reason`) is asked of the platform profile
(:mod:`dflash2.platform`: the CPU and the ``DFLASH2_*`` switches, each read once).
Nothing here imports a kernel module, so the backends import this module and never each other in a loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash2 import platform
from dflash2.atomic import atomic_path, write_text_atomic
from dflash2.locking import LockTimeout, exclusive_flock

__all__ = [
    "build_dir",
    "build_lock",
    "ensure_loaded",
    "included_headers",
    "jit_load",
    "kernels_disabled_reason",
    "missing_cpu_flags",
    "no_torch_function",
    "prune_builds",
    "self_check_mismatch",
    "self_check_record",
    "source_tag",
]

log = logging.getLogger(__name__)

# The libgomp.so.1 dependency of -fopenmp resolves to the copy torch has already loaded.
LDFLAGS = ["-fopenmp"]


# torch looks for a __torch_function__ override on every argument of an operator call; on a C++ object (a
# ScriptObject: the gguf kernel's weights and layers) the lookup raises and catches an exception inside torch, ~13 us
# per call, 29 calls per forward of the 1.5B target on gguf weights. The kernels' ops take plain CPU tensors, so their
# calls skip the lookup (torch's own context for that; a no-op where a torch lacks it).
no_torch_function = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)


def build_dir() -> Path:
    """Where kernels are built for this torch and Python: ``<home>/kernels/<tag>`` (home: ``$DFLASH2_HOME``)."""
    home = platform.settings().home
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    tag = "".join(c if c.isalnum() or c in "._-" else "_" for c in tag)
    return home / "kernels" / tag


def _ensure_ninja() -> bool:
    """torch's JIT build runs ``ninja`` from PATH; the PyPI ``ninja`` package ships one that is on
    PATH only inside an activated venv, so add its directory when needed."""
    if shutil.which("ninja"):
        return True
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except Exception:  # noqa: BLE001 - the package is optional here
        pass
    for d in candidates:
        if (d / "ninja").exists() or (d / "ninja.exe").exists():
            os.environ["PATH"] = str(d) + os.pathsep + os.environ.get("PATH", "")
            return shutil.which("ninja") is not None
    return False


def self_check_mismatch(got: torch.Tensor, ref: torch.Tensor, k: int, what: str) -> str:
    """"" when a kernel's [M, N] output over K = k inputs matches the reference to fp32 accuracy, else one line."""
    m, n = got.shape
    if torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * (k**0.5)):
        return ""
    err = (got - ref).abs().max().item()
    return f"{what}self-check failed for M={m} N={n} K={k} (max abs err {err:.3g})"


def missing_cpu_flags(flags: tuple[str, ...]) -> str:
    """``CPU lacks a/b`` for those of ``flags`` that this CPU does not list (:func:`dflash2.platform.cpu`), else ""."""
    missing = platform.cpu().missing(flags)
    return f"CPU lacks {'/'.join(missing)}" if missing else ""


def kernels_disabled_reason() -> str:
    """Why no JIT kernel may be built here ("" when one may): DFLASH2_KERNELS=off, no AVX2/FMA, no ninja."""
    off = platform.settings().kernels.reason or platform.cpu().lacks_avx2_fma()
    if off:
        return off
    if not _ensure_ninja():
        return "ninja not found (pip install ninja)"
    return ""


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included_headers(source: Path) -> list[Path]:
    """The package headers ``source`` includes (``#include "name"``, found beside it), and theirs, in order of first
    inclusion."""
    found: list[Path] = []
    pending = [source]
    while pending:
        for name in _INCLUDE.findall(pending.pop(0).read_bytes()):
            header = source.parent / name.decode()
            if header.is_file() and header not in found:
                found.append(header)
                pending.append(header)
    return found


def source_tag(source: Path, cflags: list[str] | tuple[str, ...]) -> str:
    """A build's name tag: a hash of ``source``, every package header it includes and the compiler flags, so that a
    change to any of them builds anew (torch's own check reads the source file only)."""
    code = b"".join(path.read_bytes() for path in (source, *included_headers(source)))
    return hashlib.sha256(code + " ".join(cflags).encode()).hexdigest()[:12]


def stable_source(source: Path, directory: Path) -> Path:
    """``source`` and the headers beside it, copied into ``directory``/src (each rewritten only when its bytes
    differ): the path to build from. torch's build files name a source by its path, so building the same code from
    two checkouts (a CI clone and a working tree, a wheel and a source tree) rebuilt every kernel at each switch,
    15-60 s each, inside the first forward that needed it. Call with the directory's build lock held."""
    target = directory / "src"
    target.mkdir(parents=True, exist_ok=True)
    for path in (source, *sorted(source.parent.glob("*.h"))):
        data = path.read_bytes()
        copy = target / path.name
        if not copy.exists() or copy.read_bytes() != data:
            with atomic_path(copy) as partial:
                partial.write_bytes(data)
    return target / source.name


def jit_load(kind: str, library: str, source: Path, cflags: list[str], op_name: str, self_check,
             label: str = "") -> tuple[bool, str, object]:
    """Build (or reuse) and load one kernel extension, fetch ``torch.ops.<op_name>`` and self-check it.

    The build goes to ``build_dir()/<kind>-<tag>`` as library ``<library>_<tag>``, ``tag`` being the code's
    :func:`source_tag`, and is marked as used; all but the :data:`KEEP_BUILDS` most recently used builds of ``kind``
    are deleted then. Returns (ok, one-line status, op or None); never raises for a build or load failure.
    """
    reason = kernels_disabled_reason()
    if reason:
        return False, reason, None
    tag = source_tag(source, cflags)
    directory, name = build_dir() / f"{kind}-{tag}", f"{library}_{tag}"
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            if not _load_built(directory, name):
                with announced_build(kind):
                    cpp_extension.load(
                        name=name,
                        sources=[str(stable_source(source, directory))],
                        extra_cflags=cflags,
                        extra_ldflags=LDFLAGS,
                        build_directory=str(directory),
                        is_python_module=False,
                        verbose=False,
                    )
            os.utime(directory)  # (used now: what prune_builds keeps)
        namespace, op = op_name.split(".")
        op = getattr(getattr(torch.ops, namespace), op).default
    except Exception as e:  # noqa: BLE001 - any build/load failure means: use the fallback
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return False, f"{label}kernel build failed in {directory}: {first}", None
    prune_builds(kind, keep=KEEP_BUILDS)
    record = self_check_record(directory, self_check)
    if record.is_file() and _per_process_setup(namespace, kind):
        return True, f"{label}kernel loaded from {directory} (self-check passed before on this CPU)", op
    with torch.inference_mode():
        bad = self_check(op)
    if bad:
        record.unlink(missing_ok=True)
        return False, bad, None
    _write_record(record)
    return True, f"{label}kernel loaded from {directory}", op


def cpu_key() -> str:
    """What a passed self-check holds for: this CPU's vendor, family, model, name and feature flags (a build that
    passed on one CPU may take another code path, or be refused the AMX tiles, on another one)."""
    info = platform.cpu()
    return "|".join((info.vendor, str(info.family), str(info.model), info.name, " ".join(sorted(info.flags))))


def self_check_record(directory: Path, self_check=None) -> Path:
    """The file that says a build's self-check passed on this CPU. The build directory is named by the hash of the
    kernel's code and flags and lies under the torch and Python version; the record's name hashes the CPU
    (:func:`cpu_key`) and the source of the module that defines ``self_check`` (where the check and the packing it
    feeds the kernel are written), so it holds for exactly that build, check and CPU: the self-checks (up to ~0.6 s of
    CPU each, in every process that loads a kernel) run once per build and CPU instead."""
    key = cpu_key().encode()
    module = sys.modules.get(getattr(self_check, "__module__", None) or "")
    source = getattr(module, "__file__", None)
    if source:
        with contextlib.suppress(OSError):
            key += Path(source).read_bytes()
    return directory / f"self-check-passed-{hashlib.sha256(key).hexdigest()[:12]}"


def _write_record(record: Path) -> None:
    """Write the record atomically (a process killed mid-write leaves none, and the check runs again); a store that
    cannot be written to only costs the check in every process."""
    try:
        write_text_atomic(record, f"{platform.cpu().name}\n")
    except OSError as e:
        log.debug("self-check record %s not written: %s", record, e)


# Ops a kernel library exposes that must run in every process that uses it, whatever the record says; each returns
# whether the kernel may run. Linux grants the AMX tile state per process (``arch_prctl``), and the AMX builds' self-
# checks were where it was asked for.
_PER_PROCESS_OPS = ("amx_init", "gguf_tiles")


def _per_process_setup(namespace: str, kind: str) -> bool:
    """Run the library's per-process ops; False (then the self-check runs and reports why) when an AMX build (its kind
    names ``amx``) is refused the tiles. The gguf builds without AMX answer False to ``gguf_tiles`` by design."""
    ops = getattr(torch.ops, namespace)
    granted = [getattr(ops, name)() for name in _PER_PROCESS_OPS if hasattr(ops, name)]
    return all(granted) if "amx" in kind else True


@contextlib.contextmanager
def announced_build(kind: str) -> Iterator[None]:
    """One line on stderr per kernel compiled: a build takes 15-60 s on 2 cores and happens inside the first forward
    that needs the kernel (or in ``dflash2 kernels build``); without a word the first run looked hung."""
    print(f"dflash2: compiling the {kind} kernel (once per kernel version) ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _load_built(directory: Path, name: str) -> bool:
    """Load the library built earlier in ``directory`` (whose name carries the code's :func:`source_tag`: the same
    source, headers and flags; the directory is per torch and Python version), without torch's builder: that re-runs
    ninja, whose build file names the torch headers of the environment that built it, so a build made from another
    virtual environment of the same torch (a CI clone's) was built again, 15-60 s per kernel, inside the first forward.
    False (build it) when there is no such library or it does not load."""
    library = directory / f"{name}.so"
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        log.warning("rebuilding %s: %s", library, e)
        return False
    return True


# Builds kept per kernel kind. Each change of a kernel's code builds anew beside the old builds (a few MB each): an
# upgrade, a checkout of another revision, a CI clone; three keep a working tree, a clone and one more without
# rebuilding.
KEEP_BUILDS = 3


def prune_builds(kind: str, keep: int = KEEP_BUILDS) -> list[Path]:
    """Delete all but the ``keep`` most recently used builds of ``kind`` (``<kind>-<tag>`` in :func:`build_dir`; a
    build's directory is touched whenever it is loaded), skipping any a live process holds the build lock of, and
    the remains of a deletion that was cut short. Returns the deleted directories; never raises."""
    root = build_dir()
    tagged = re.compile(re.escape(kind) + r"-[0-9a-f]{12}")
    try:
        builds = [p for p in root.iterdir() if p.is_dir() and tagged.fullmatch(p.name)]
        builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        leftovers = [p for p in root.iterdir() if tagged.fullmatch(p.name.partition(".deleting-")[0])
                     and ".deleting-" in p.name]
    except OSError as e:
        log.warning("not pruning old %s builds in %s: %s", kind, root, e)
        return []
    deleted = []
    for old in builds[keep:]:
        doomed = old.with_name(f"{old.name}.deleting-{os.getpid()}")
        try:
            with exclusive_flock(old / "dflash2-build.lock", 0):
                old.rename(doomed)  # (atomic: a process that wants this build from now on builds it anew)
        except (LockTimeout, OSError):
            continue  # in use: kept
        leftovers.append(doomed)
        deleted.append(old)
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if deleted:
        log.info("deleted %d old %s kernel build(s) in %s", len(deleted), kind, root)
    return deleted


BUILD_LOCK_TIMEOUT_ENV = "DFLASH2_BUILD_LOCK_TIMEOUT"


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` while torch builds or loads the extension there.

    torch's own guard (a ``lock`` file created by ``FileBaton``) outlives a process killed mid-build, and every later
    process then waits for it forever. An ``flock`` is released by the kernel when its holder dies, so whoever holds
    this one knows that no live dflash2 process is building here and deletes a ``lock`` file left behind. Raises
    TimeoutError after ``timeout_s`` (``$DFLASH2_BUILD_LOCK_TIMEOUT``, default 1800 s) of waiting for a live build.
    """
    timeout = timeout_s if timeout_s is not None else platform.settings().build_lock_timeout_s
    try:
        with exclusive_flock(directory / "dflash2-build.lock", timeout, f"waiting for a kernel build in {directory}"):
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
    except LockTimeout:
        raise TimeoutError(f"another process has been building in {directory} for over {timeout:.0f} s "
                           f"(${BUILD_LOCK_TIMEOUT_ENV} sets the wait)") from None


def ensure_loaded(state: dict[str, object], lock: threading.Lock, load, what: str, warn: bool = True) -> None:
    """Run ``load()`` once per process into ``state`` (available, status, op); warn once if it failed (``warn``)."""
    if "available" in state:
        return
    with lock:
        if "available" in state:
            return
        ok, status, op = load()
        state.update(available=ok, status=status, op=op)
        if ok:
            log.info("dflash2 kernels: %s", status)
        elif warn:
            warnings.warn(f"dflash2: {what} unavailable ({status}); using the slower PyTorch fallback",
                          RuntimeWarning, stacklevel=4)
