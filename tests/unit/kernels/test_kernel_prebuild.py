"""``dflash2 kernels build``: the default path's kernels built ahead of the first generation, one line per compile."""

from __future__ import annotations

import pytest

from dflash2.kernels import jit
from dflash2.kernels.prebuild import KERNELS, build_kernels


def test_a_compile_says_so_in_one_line(capsys):
    with jit.announced_build("demo"):
        pass
    with pytest.raises(RuntimeError), jit.announced_build("broken"):
        raise RuntimeError("compiler error")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("dflash2: compiling the demo kernel") and err[0].endswith(" s")
    assert err[1].startswith("dflash2: compiling the broken kernel") and err[1].endswith(" failed")


def test_build_reports_every_default_path_kernel_with_where_it_is_or_why_not():
    reports = list(build_kernels())
    assert [name for name, _, _ in reports] == [k.name for k in KERNELS if k.default_path]
    for name, usable, status in reports:
        assert status and "\n" not in status
        if usable:
            assert str(jit.build_dir()) in status, (name, status)  # loaded from the directory the forward uses
    from dflash2.kernels.packed_linear import kernels_available

    assert reports[0][1] == kernels_available()  # the same state the model's layers read
