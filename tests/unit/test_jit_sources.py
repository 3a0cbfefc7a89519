"""A kernel builds from a copy of its sources inside its build directory, so two checkouts of the same code share
one build (torch's build files name the source by its path: each switch between a CI clone and a working tree
rebuilt every kernel, 15-60 s each, inside the first forward)."""

from __future__ import annotations

import os

from dflash2.kernels.jit import stable_source


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
