"""The platform profile (dflash2.platform): the DFLASH2_* variables are read in that module only, each is documented
in docs/usage.md's table, parsed once into typed settings (a bad value raised where its setting is used), and each
weight format's backend is chosen by one table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dflash2 import platform
from dflash2.platform import BACKENDS, VARIABLES, CpuInfo, Settings, choose_backend, cpu_from_fields

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "dflash2"
PLATFORM = PACKAGE / "platform.py"
NAME = re.compile(r"\bDFLASH2_[A-Z0-9_]+\b")


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module's ``NAME = "string"`` assignments (``ENV = "DFLASH2_..."``)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, key) of every read of one environment variable in ``path``: ``os.environ.get(k)``,
    ``os.environ[k]``, ``os.getenv(k)``, ``k in os.environ``; the key as written when it is not a string (a literal
    or a module constant), ``?`` then."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    constants = _constants(tree)

    def key(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # module.CONSTANT: checked by name
            return f"?{node.attr}"
        return "?"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and ((f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv"):
                reads.append((node.lineno, key(node.args[0])))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.lineno, key(node.left)))
    return reads


def test_the_reader_finds_every_form_of_reading(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('import os\nENV = "DFLASH2_X"\na = os.environ.get("DFLASH2_A")\nb = os.environ[ENV]\n'
                      'c = os.getenv("HOME")\nd = "DFLASH2_D" in os.environ\ne = os.environ.get(name)\n'
                      'os.environ["PATH"] = "x"\n')
    assert environment_reads(module) == [(3, "DFLASH2_A"), (4, "DFLASH2_X"), (5, "HOME"), (6, "DFLASH2_D"),
                                         (7, "?")]


def test_dflash2_variables_are_read_in_the_platform_module_only():
    """Every other module asks dflash2.platform.settings(); a read whose key is not a plain string elsewhere could
    be one of ours, so it fails too."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PLATFORM:
            continue
        for line, key in environment_reads(path):
            if key.startswith("?") or key.startswith("DFLASH2_"):
                bad.append(f"{path.relative_to(ROOT)}:{line} reads {key}")
    assert not bad, "environment read outside dflash2/platform.py:\n" + "\n".join(bad)


def _documented() -> list[str]:
    """The variables of the table in docs/usage.md's "Environment variables" section, in order."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(DFLASH2_[A-Z0-9_]+)` \|", section, flags=re.MULTILINE)


def test_every_variable_named_in_the_code_is_in_the_one_table_and_documented():
    declared = [v.name for v in VARIABLES]
    assert len(declared) == len(set(declared))
    named = {m for path in PACKAGE.rglob("*.py") for m in NAME.findall(path.read_text(encoding="utf-8"))}
    assert named <= set(declared), f"named in src/ but not in platform.VARIABLES: {sorted(named - set(declared))}"
    parsed = [name for name, _, _ in platform._PARSERS]
    assert parsed == declared  # every variable parsed, in the table's order
    assert _documented() == declared  # docs/usage.md's table: the same variables, the same order


def test_settings_are_parsed_once_and_reloaded_on_request(monkeypatch):
    first = platform.settings()
    assert platform.settings() is first  # the same object: nothing re-reads the environment
    monkeypatch.setenv("DFLASH2_ATTENTION", "torch")
    assert platform.settings() is first and not first.attention.off
    reloaded = platform.reload_settings()
    assert reloaded.attention.off and platform.settings() is reloaded


def test_values_parse_into_typed_settings():
    s = Settings.from_environ({
        "DFLASH2_HOME": "/tmp/h", "DFLASH2_AMX": "Off", "DFLASH2_GGUF_KERNEL": "vnni", "DFLASH2_GGUF_PAIR_ROWS": "3",
        "DFLASH2_QUANT_CACHE": "no", "DFLASH2_HUGE_PAGES": "always", "DFLASH2_PARD_CATCH_UP": "all",
        "DFLASH2_PARD_WINDOW": "16,240", "DFLASH2_LOCK_TIMEOUT": "0.5", "DFLASH2_KEEP_WHEELS": "yes",
        "DFLASH2_API_KEY": "s3cr3t", "DFLASH2_PARD_WEIGHTS": "Q4_0"})
    assert s.home == Path("/tmp/h") and s.amx.off and s.amx.reason == "disabled by DFLASH2_AMX=Off"
    assert not s.kernels.off and s.kernels.reason == ""
    assert (s.gguf_kernel, s.gguf_pair_rows, s.quant_cache, s.huge_pages) == ("avx512-vnni", 3, False, "on")
    assert (s.pard_catch_up, s.pard_window, s.lock_timeout_s, s.keep_wheels) == ("all", (16, 240), 0.5, True)
    assert s.pard_weights == "q4_0" and s.api_key == "s3cr3t" and "s3cr3t" not in repr(s)  # kept out of logs
    unset = Settings.from_environ({})
    assert unset == Settings() and unset.home == Path("~/.cache/dflash2").expanduser()
    assert (unset.gguf_kernel, unset.pard_catch_up, unset.build_lock_timeout_s, unset.huge_pages) == \
        (None, None, 1800.0, "auto")


def test_a_bad_value_is_raised_where_its_setting_is_used():
    s = Settings.from_environ({"DFLASH2_GGUF_KERNEL": "bogus", "DFLASH2_PARD_WINDOW": "32"})
    s.check("DFLASH2_QUANT_CACHE")  # another setting: fine
    with pytest.raises(ValueError, match="DFLASH2_GGUF_KERNEL='bogus': expected amx, vnni, avx2 or torch"):
        choose_backend("gguf", lambda backend: True, s)
    with pytest.raises(ValueError, match="DFLASH2_PARD_WINDOW must be SINK,RECENT"):
        s.check("DFLASH2_PARD_WINDOW")
    assert choose_backend("bf16", lambda backend: True, s) == "amx"  # a bad gguf switch stops no other format


def test_one_table_chooses_every_formats_backend():
    unset = Settings.from_environ({})
    everything, nothing = (lambda backend: True), (lambda backend: False)
    for weights, order in BACKENDS.items():
        assert choose_backend(weights, everything, unset) == order[0]  # the fastest, where all loaded
    assert [choose_backend(w, nothing, unset) for w in ("bf16", "int8", "int4")] == ["torch"] * 3
    assert choose_backend("gguf", nothing, unset) == "avx2"  # the caller finds it unusable: an error, no fallback
    only = {"avx2"}
    assert choose_backend("bf16", only.__contains__, unset) == "avx2"
    amx_off = Settings.from_environ({"DFLASH2_AMX": "off"})
    assert choose_backend("gguf", everything, amx_off) == "avx512-vnni"  # the machine-wide AMX switch
    assert choose_backend("gguf", nothing, Settings.from_environ({"DFLASH2_GGUF_KERNEL": "amx"})) == "amx-int8"
    assert choose_backend("gguf", everything, Settings.from_environ({"DFLASH2_GGUF_KERNEL": "off"})) == "torch"
    with pytest.raises(ValueError, match="unknown weight format"):
        choose_backend("fp8", everything, unset)


def test_the_cpu_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
                    "model name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2 fma amx_tile\n\nprocessor\t: 1\n"
                    "vendor_id\t: Other\n")
    xeon = cpu_from_fields(platform.read_cpuinfo(info), "x86_64")
    assert (xeon.vendor, xeon.family, xeon.model, xeon.name) == ("GenuineIntel", 6, 207, "Intel(R) Xeon(R)")
    assert xeon.missing(("avx2", "amx_int8")) == ("amx_int8",) and xeon.lacks_avx2_fma() == "" and not xeon.zen
    assert CpuInfo("AuthenticAMD", 25).zen and not CpuInfo("AuthenticAMD", 26).zen
    assert CpuInfo(machine="aarch64").lacks_avx2_fma() == "CPU architecture 'aarch64' is not x86"
    assert CpuInfo(flags=frozenset({"avx2"}), machine="x86_64").lacks_avx2_fma() == "CPU lacks FMA"
    assert platform.read_cpuinfo(tmp_path / "missing") == {}


def test_the_cpu_is_read_in_the_platform_module_only():
    """No other module opens /proc/cpuinfo: platform.cpu() reads it once for all."""
    readers = [str(path.relative_to(ROOT)) for path in sorted(PACKAGE.rglob("*.py")) if path != PLATFORM and any(
        isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))]
    assert not readers, f"read /proc/cpuinfo themselves: {readers}"
