"""The CLI's parsers build, and `dflash2 models list` runs, without importing torch (dflash2.lazy,
models/conversion.py): `dflash2 --help`, argument errors and the listing answer at once; the lazily loaded names
still resolve."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Builds every subcommand's parser (what `dflash2 --help` and an argument error do), then reports what was imported.
PARSERS_ONLY = """
import sys
from dflash2.cli import build_parser
build_parser().parse_args(["generate", "--drafter", "pard:1+4x3", "hi"])
print("torch" in sys.modules)
"""

# `dflash2 models list` (the store's inventory: it reads directories, converts nothing), then what was imported.
MODELS_LIST = """
import sys
from dflash2.cli import main
main(["models", "list"])
print("torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("code,verdict", [(PARSERS_ONLY, lambda done: done.stdout),
                                          (MODELS_LIST, lambda done: done.stderr.splitlines()[-1])],
                         ids=["parsers", "models-list"])
def test_imports_no_torch(code, verdict, tmp_path):
    env = {**os.environ, "DFLASH2_HOME": str(tmp_path)}  # (an empty store: nothing to list, nothing to pull)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert verdict(done).strip() == "False"


@pytest.mark.parametrize("package", ["dflash2", "dflash2.drafters", "dflash2.train"])
def test_every_exported_name_resolves(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in vars(module), name  # kept after the first lookup
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(module, "not_a_name")
