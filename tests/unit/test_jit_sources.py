"""A kernel builds from a copy of its sources inside its build directory, so two checkouts of the same code share
one build (torch's build files name the source by its path: each switch between a CI clone and a working tree
rebuilt every kernel, 15-60 s each, inside the first forward); its build tag follows every header it includes; a
build of the same code is loaded as it is, whichever virtual environment built it."""

from __future__ import annotations

import os

import pytest

from dflash2.kernels.jit import included_headers, source_tag, stable_source


def _checkout(root, body: bytes, header: bytes):
    root.mkdir()
    (root / "k.cpp").write_bytes(body)
    (root / "k.h").write_bytes(header)
    (root / "notes.txt").write_text("not a source")
    return root / "k.cpp"


def test_two_checkouts_of_the_same_code_build_from_one_path(tmp_path):
    build = tmp_path / "build"
    first = stable_source(_checkout(tmp_path / "a", b"#include \"k.h\"\n", b"int x;\n"), build)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.parent.iterdir()}
    os.utime(first, ns=(1, 1))  # an unchanged copy keeps its time stamp: nothing for ninja to rebuild
    second = stable_source(_checkout(tmp_path / "b", b"#include \"k.h\"\n", b"int x;\n"), build)
    assert first == second == build / "src" / "k.cpp"
    assert sorted(p.name for p in first.parent.iterdir()) == ["k.cpp", "k.h"]  # the source and its headers
    assert second.stat().st_mtime_ns == 1
    assert (build / "src" / "k.h").stat().st_mtime_ns == mtimes["k.h"]


def test_changed_bytes_are_copied_again(tmp_path):
    build = tmp_path / "build"
    stable_source(_checkout(tmp_path / "a", b"old\n", b"int x;\n"), build)
    path = stable_source(_checkout(tmp_path / "b", b"new\n", b"int y;\n"), build)
    assert path.read_bytes() == b"new\n"
    assert (build / "src" / "k.h").read_bytes() == b"int y;\n"
    assert not list((build / "src").glob("*.partial"))


def test_the_build_tag_follows_every_header_a_source_includes(tmp_path):
    """A change to a header included through another header builds anew (torch's own check reads the source only);
    headers the source does not include, and system headers, do not count."""
    root = tmp_path / "src"
    root.mkdir()
    source = root / "k.cpp"
    source.write_bytes(b'#include <vector>\n#include "a.h"\nint main() {}\n')
    (root / "a.h").write_bytes(b'#pragma once\n  #  include "b.h"\n')
    (root / "b.h").write_bytes(b"int b;\n")
    (root / "unused.h").write_bytes(b"int u;\n")
    assert included_headers(source) == [root / "a.h", root / "b.h"]
    tag = source_tag(source, ["-O3"])
    assert len(tag) == 12 and source_tag(source, ["-O3"]) == tag
    (root / "unused.h").write_bytes(b"int v;\n")
    assert source_tag(source, ["-O3"]) == tag
    (root / "b.h").write_bytes(b"int c;\n")
    changed = source_tag(source, ["-O3"])
    assert changed != tag
    assert source_tag(source, ["-O2"]) != changed


def test_every_package_kernel_names_its_headers_in_its_tag():
    """The gguf kernel: every header it includes is found, those included by another header too."""
    from dflash2.kernels import gguf_linear

    names = {p.name for p in included_headers(gguf_linear._SOURCE)}
    assert {"gemm_gguf_vnni.h", "gemm_gguf_amx.h", "amx_tiles.h", "gguf_layer.h", "tile_store.h",
            "chunked_for.h"} <= names


def test_kernel_calls_skip_the_torch_function_lookup():
    """The pinned torch has the context that skips the per-argument __torch_function__ lookup (on a ScriptObject
    argument it raises and catches an exception inside torch, ~13 us per call): were it gone, gguf forwards would
    silently slow down."""
    import torch

    from dflash2.kernels import jit

    assert jit.no_torch_function is torch._C.DisableTorchFunctionSubclass
    assert torch._C._is_torch_function_enabled()
    with jit.no_torch_function():
        assert not torch._C._is_torch_function_enabled()
    assert torch._C._is_torch_function_enabled()  # (only inside)


def _fake_kernel(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    source = root / "k.cpp"
    source.write_bytes(b'#include "k.h"\n')
    (root / "k.h").write_bytes(b"int x;\n")
    return source, tmp_path / "build"


def test_a_build_of_this_exact_code_is_loaded_as_it_is(tmp_path, monkeypatch):
    """A library whose name carries the code's tag is loaded without torch's builder (whose ninja file names the
    torch headers of the environment that built it: a CI clone's build was built again in the working tree)."""
    import torch
    from torch.utils import cpp_extension

    from dflash2.kernels import jit

    source, build = _fake_kernel(tmp_path)
    build.mkdir()
    name = f"k_{source_tag(source, ['-O3'])}"
    (build / f"{name}.so").write_bytes(b"")  # (stands for the library built earlier)
    loaded = []
    monkeypatch.setattr(jit, "kernels_disabled_reason", lambda: "")
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built again"))
    ok, status, op = jit.jit_load(name, source, ["-O3"], build, "aten.add", lambda op: "")
    assert ok, status
    assert loaded == [str(build / f"{name}.so")] and op is torch.ops.aten.add.default


def test_changed_code_or_a_library_that_does_not_load_is_built(tmp_path, monkeypatch):
    import torch
    from torch.utils import cpp_extension

    from dflash2.kernels import jit

    source, build = _fake_kernel(tmp_path)
    build.mkdir()
    old = f"k_{source_tag(source, ['-O3'])}"
    (build / f"{old}.so").write_bytes(b"")
    (source.parent / "k.h").write_bytes(b"int y;\n")  # the code changed: another tag
    new = f"k_{source_tag(source, ['-O3'])}"
    (build / f"{new}.so").write_bytes(b"")
    built = []
    monkeypatch.setattr(jit, "kernels_disabled_reason", lambda: "")
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]))

    def broken(path):
        raise OSError(f"{path}: file too short")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    assert jit.jit_load(new, source, ["-O3"], build, "aten.add", lambda op: "")[0]  # does not load: built
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail("loaded a stale library"))
    assert jit.jit_load(old, source, ["-O3"], build, "aten.add", lambda op: "")[0]  # stale name: built
    assert built == [new, old]
