"""``dflash2 kernels build``: the default path's kernels built ahead of the first generation, one line per compile."""

from __future__ import annotations

import pytest

from dflash2 import platform
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


def _cannot_run_here(status: str) -> bool:
    """A kernel left out for a reason of this machine or its settings, not for a defect of the kernel."""
    settings_off = [platform.settings().amx.reason, platform.settings().dpbf16.reason, jit.kernels_disabled_reason()]
    return (status.startswith("CPU lacks") or status.startswith("Linux refused")
            or any(reason and status == reason for reason in settings_off))


def test_every_kernel_this_cpu_can_run_builds_and_passes_its_self_check():
    # The kernel tests skip a kernel that is unavailable, and the model layers fall back to PyTorch, so without this
    # a kernel that stopped compiling (or computing the reference's bits) on a CPU that has its instructions would
    # leave the suite green.
    failed = [f"{name}: {status}" for name, usable, status in build_kernels(everything=True)
              if not usable and not _cannot_run_here(status)]
    assert not failed, "\n".join(failed)
