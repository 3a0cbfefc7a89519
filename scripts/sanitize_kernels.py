"""Run the C++ kernels' tests once with AddressSanitizer and UndefinedBehaviorSanitizer.

Every kernel (``kernels/*.cpp`` through :func:`dflash2.kernels.jit.jit_load`) is built again with
``-fsanitize=address,undefined`` into a store of its own (``$DFLASH2_SANITIZE_HOME``, default
``/tmp/dflash2-sanitize``: the builds' names hash their flags, and sharing the user's store would let these builds
push the real ones out of the kept few), Python is re-executed with the sanitizer runtimes preloaded (an uninstrumented
interpreter loading an instrumented library needs ASan's runtime first), and pytest runs the kernel tests. A read past
a tensor's memory or undefined behaviour in a kernel ends the run with the sanitizer's report and a non-zero exit.

    nice -n 15 .venv/bin/python scripts/sanitize_kernels.py                 # the kernel tests (several minutes)
    nice -n 15 .venv/bin/python scripts/sanitize_kernels.py tests/unit/kernels/test_attention.py -k rows

Leak detection is off: CPython and torch keep allocations alive on purpose until exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# -O1 after the kernels' own -O3: the sanitizers' recommended level, and an instrumented -O3 build of the GGUF
# kernels' unrolled templates compiled for over 30 minutes on 2 cores
FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
KERNEL_TESTS = ["tests/unit/kernels/test_packed_linear.py", "tests/unit/kernels/test_quant_linear.py",
                "tests/unit/kernels/test_attention.py", "tests/unit/kernels/test_layer_ops.py",
                "tests/unit/kernels/test_gguf_layer.py", "tests/unit/kernels/test_gguf_blocks.py",
                "tests/unit/kernels/test_amx_linear.py", "tests/unit/kernels/test_kernel_boundary.py",
                "tests/unit/test_row_invariance.py"]
_MARK = "DFLASH2_SANITIZE_CHILD"


def _runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()


class SanitizedBuilds:
    """A pytest plugin: every kernel build gets the sanitizer flags (compile and link)."""

    def pytest_configure(self, config) -> None:
        from dflash2.kernels import jit, packed_linear

        original = jit.jit_load

        def sanitized(kind, library, source, cflags, op_name, self_check, label=""):
            return original(f"{kind}-asan", library, source, [*cflags, *FLAGS], op_name, self_check, label=label)

        jit.jit_load = sanitized
        packed_linear.jit_load = sanitized  # imported by name there
        jit.LDFLAGS[:] = [*jit.LDFLAGS, *FLAGS]


def main(argv: list[str]) -> int:
    if os.environ.get(_MARK) != "1":
        env = dict(os.environ, **{_MARK: "1"})
        env["LD_PRELOAD"] = " ".join([_runtime("libasan.so"), _runtime("libubsan.so"), env.get("LD_PRELOAD", "")]).strip()
        env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:abort_on_error=0:allocator_may_return_null=1"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
        env["DFLASH2_HOME"] = env.get("DFLASH2_SANITIZE_HOME", "/tmp/dflash2-sanitize")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
        return subprocess.call([sys.executable, __file__, *argv], env=env, cwd=ROOT)
    import pytest

    args = argv or KERNEL_TESTS
    return pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not slow", *args], plugins=[SanitizedBuilds()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
