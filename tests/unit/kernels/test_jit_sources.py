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


def _fake_kernel(tmp_path, monkeypatch):
    """A kernel source with a header, a build root of its own, and kernels allowed (the tests never compile)."""
    from dflash2.kernels import jit

    root = tmp_path / "src"
    root.mkdir()
    source = root / "k.cpp"
    source.write_bytes(b'#include "k.h"\n')
    (root / "k.h").write_bytes(b"int x;\n")
    monkeypatch.setattr(jit, "build_dir", lambda: tmp_path / "build")
    monkeypatch.setattr(jit, "kernels_disabled_reason", lambda: "")
    return source, tmp_path / "build"


def _built(build, source, kind="k", library="lib_k"):
    """Stand-in for a library built earlier from ``source``: (its directory, its file)."""
    tag = source_tag(source, ["-O3"])
    directory = build / f"{kind}-{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    library_file = directory / f"{library}_{tag}.so"
    library_file.write_bytes(b"")
    return directory, library_file


def test_a_build_of_this_exact_code_is_loaded_as_it_is(tmp_path, monkeypatch):
    """A library whose name carries the code's tag is loaded without torch's builder (whose ninja file names the
    torch headers of the environment that built it: a CI clone's build was built again in the working tree)."""
    import torch
    from torch.utils import cpp_extension

    from dflash2.kernels import jit

    source, build = _fake_kernel(tmp_path, monkeypatch)
    directory, library = _built(build, source)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built again"))
    ok, status, op = jit.jit_load("k", "lib_k", source, ["-O3"], "aten.add", lambda op: "", label="test ")
    assert ok and status == f"test kernel loaded from {directory}"
    assert loaded == [str(library)] and op is torch.ops.aten.add.default


def test_changed_code_or_a_library_that_does_not_load_is_built(tmp_path, monkeypatch):
    import torch
    from torch.utils import cpp_extension

    from dflash2.kernels import jit

    source, build = _fake_kernel(tmp_path, monkeypatch)
    old_directory, _ = _built(build, source)
    (source.parent / "k.h").write_bytes(b"int y;\n")  # the code changed: another tag
    new_directory, _ = _built(build, source)
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append((kw["name"], kw["build_directory"])))

    def broken(path):
        raise OSError(f"{path}: file too short")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    assert jit.jit_load("k", "lib_k", source, ["-O3"], "aten.add", lambda op: "")[0]  # does not load: built
    assert built == [(f"lib_k_{new_directory.name[2:]}", str(new_directory))]
    (source.parent / "k.h").write_bytes(b"int z;\n")
    assert jit.jit_load("k", "lib_k", source, ["-O3"], "aten.add", lambda op: "")[0]  # no build of this code: built
    assert built[1][1] not in (str(old_directory), str(new_directory))


def _kinds_builds(build, kind):
    return sorted(p.name for p in build.iterdir() if p.name.startswith(f"{kind}-"))


def test_old_builds_of_a_kind_are_pruned_to_the_most_recently_used(tmp_path, monkeypatch):
    """Every change of a kernel's code builds anew; the builds of a kind beyond the most recently used few are
    deleted (an upgrade or a checkout of another revision no longer grows the cache by a build per kernel), never
    those of another kind, those another process holds the build lock of, or anything that is not a build."""
    from dflash2.kernels import jit
    from dflash2.locking import exclusive_flock

    _, build = _fake_kernel(tmp_path, monkeypatch)
    names = [f"k-{i:012x}" for i in range(6)]
    for age, name in enumerate(names):
        (build / name).mkdir(parents=True)
        (build / name / "lib.so").write_bytes(b"x")
        (build / name / "dflash2-build.lock").touch()
        os.utime(build / name, (1000 - age, 1000 - age))  # names[0] used last
    others = ["k-old-000000000000", "kk-000000000000", "k-0000000000zz"]
    for name in others:
        (build / name).mkdir()
    (build / "k-000000000009.deleting-1").mkdir()  # a deletion cut short
    with exclusive_flock(build / names[4] / "dflash2-build.lock", 1):  # another process is loading that one
        deleted = jit.prune_builds("k", keep=3)
    assert sorted(deleted) == [build / names[3], build / names[5]]
    assert _kinds_builds(build, "k") == sorted([*names[:3], names[4], others[0], others[2]])
    assert (build / others[1]).is_dir()


def test_loading_a_kernel_marks_its_build_used_and_prunes_the_rest(tmp_path, monkeypatch):
    import torch

    from dflash2.kernels import jit

    source, build = _fake_kernel(tmp_path, monkeypatch)
    directory, _ = _built(build, source)
    os.utime(directory, (1, 1))  # the oldest
    stale = []
    for i in range(jit.KEEP_BUILDS):
        stale.append(build / f"k-{i:012x}")
        stale[-1].mkdir()
        os.utime(stale[-1], (100 + i, 100 + i))  # stale[0] the oldest of them
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    assert jit.jit_load("k", "lib_k", source, ["-O3"], "aten.add", lambda op: "")[0]
    assert directory.is_dir() and directory.stat().st_mtime > 1
    assert _kinds_builds(build, "k") == sorted(p.name for p in [directory, *stale[1:]])
