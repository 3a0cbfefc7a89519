"""Package names that load on first use (PEP 562): the packages the CLI's parsers import (``dflash2``,
``dflash2.drafters``, ``dflash2.train``) re-export names whose modules import torch (~2 s on 2 cores); resolved lazily,
``dflash2 --help`` and the commands' argument errors answer without that import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: name -> the attribute of that name in module ``homes[name]``,
    imported on first use and kept in ``namespace`` (the package's globals), so later lookups are plain."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
