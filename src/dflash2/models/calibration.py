"""The target's verify cost per row count, measured on this machine (``DFLASH2_VERIFY_CALIBRATION=on``).

Whether one request should verify a tree of drafts (13 rows) or a chain (4 rows) depends on how a forward's cost
grows with its rows, which depends on the CPU, the weight format and the kernels. ``auto`` decides it by a rule
measured on one machine (whole-K AMX tiles: trees; elsewhere: chains, drafters/spec.py); with the calibration on
it is decided by this machine's own numbers: a forward of 1, 2, 4, 8 and 16 rows after a short cached context,
timed once per CPU, model shape, weight format and kernel code, and cached in the model store
(``$DFLASH2_HOME/calibration/<key>.json``)."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dflash2 import platform
from dflash2.atomic import write_text_atomic
from dflash2.platform import VerifyCosts

__all__ = ["ROWS", "calibrated", "calibration_key", "measure", "verify_costs"]

ROWS = (1, 2, 4, 8, 16)  # the row counts timed (a chain of k = 3 is 4 rows, a 4x3 tree 13)
CACHED = 128  # positions in the cache before the timed rows (a short prompt)
PASSES = 3  # timed forwards per row count (the median is kept), after one untimed
KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _weight_format(model: nn.Module) -> str:
    """The first layer's gate / up projection's format and backend: ``bf16/amx``, ``int8/avx2``, ``gguf/...``,
    ``torch`` for a plain ``nn.Linear``."""
    layer = model.layers[0].ffn.w_gate_up
    backend = getattr(layer, "backend", None)
    return "torch" if backend is None else f"{getattr(layer, 'weights', 'bf16')}/{backend}"


def calibration_key(model: nn.Module) -> str:
    """What the costs depend on: the CPU (vendor, family, model, name), the model's shape and dtype, its weight
    format and backend, the kernels' code (every C++ source and header) and the threads."""
    machine = platform.cpu()
    sources = sorted(p for p in KERNELS.iterdir() if p.suffix in (".cpp", ".h"))
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    parts = [machine.vendor, str(machine.family), str(machine.model), machine.name, repr(model.config),
             str(model.dtype), _weight_format(model), code, str(torch.get_num_threads()), ",".join(map(str, ROWS))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def measure(model: nn.Module, rows: tuple[int, ...] = ROWS, cached: int = CACHED, passes: int = PASSES
            ) -> VerifyCosts:
    """Time a forward of each of ``rows`` rows (all logits, as verification asks) after ``cached`` positions."""
    vocab = model.config.vocab_size
    cache = model.new_cache(cached + max(rows))
    model(torch.arange(cached)[None] % vocab, cache=cache, logits="none")
    seconds = []
    for n in rows:
        block = (torch.arange(n)[None] + 7) % vocab  # [1, n]
        times = []
        for _ in range(passes + 1):
            cache.rollback(cached)
            start = time.perf_counter()
            model(block, cache=cache, logits="all")
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times[1:]))
    cache.rollback(cached)
    return VerifyCosts(tuple(rows), tuple(seconds))


def verify_costs(model: nn.Module, home: Path | None = None) -> VerifyCosts:
    """This machine's costs for ``model``: read from the store's calibration cache, else measured and written."""
    path = (home or platform.settings().home) / "calibration" / f"{calibration_key(model)}.json"
    try:
        saved = json.loads(path.read_text())
        return VerifyCosts(tuple(saved["rows"]), tuple(saved["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"rows": costs.rows, "seconds": costs.seconds, "cpu": platform.cpu().name,
                                        "weights": _weight_format(model)}))
    return costs


def calibrated(hardware: platform.DraftHardware, model: nn.Module | None) -> platform.DraftHardware:
    """``hardware`` with this machine's :func:`verify_costs` of ``model`` where ``DFLASH2_VERIFY_CALIBRATION=on``
    (unchanged otherwise, or without a model)."""
    if model is None or not platform.settings().verify_calibration:
        return hardware
    return replace(hardware, verify_costs=verify_costs(model))
