"""The CLI's parsers build without importing torch (dflash2.lazy): `dflash2 --help` and argument errors answer at
once; the lazily loaded names still resolve to their modules' objects."""

from __future__ import annotations

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


def test_building_every_parser_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", PARSERS_ONLY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("package", ["dflash2", "dflash2.drafters", "dflash2.train"])
def test_every_exported_name_resolves(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in vars(module), name  # kept after the first lookup
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(module, "not_a_name")
