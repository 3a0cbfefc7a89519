"""Real models from the model store (pulled on first use; CI pulls SmolLM2 and the Qwen pair)."""

from __future__ import annotations

import functools
import gc

import pytest

SMOLLM2 = "smollm2-135m-instruct"
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"

MODEL_PARAMS = [
    pytest.param(SMOLLM2, marks=pytest.mark.model, id="smollm2"),
    # the 0.5B shares the 1.5B's architecture and loader: its oracle (~55 s) runs with `make test-all`
    pytest.param(QWEN_DRAFT, marks=[pytest.mark.model, pytest.mark.qwen, pytest.mark.slow], id="qwen-0.5b"),
    pytest.param(QWEN_TARGET, marks=[pytest.mark.model, pytest.mark.qwen], id="qwen-1.5b"),
]


@functools.lru_cache(maxsize=None)
def model_dir(name: str, dtype: str):
    from dflash2.models.store import resolve_model

    return resolve_model(name, dtype)


class _EngineCache:
    """Cached engines (plain decoding); tests set ``engine.drafter`` themselves and reset it. At most one Qwen-sized
    engine at a time (the fp32 1.5B is 7.1 GB resident; beside a bf16 copy the run peaked at 13.4 GB), and the
    SmolLM2 ones (0.5 GB in fp32) beside it. A test that loads a big model of its own calls ``cache_clear()``."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, str], object] = {}

    def __call__(self, name: str, dtype: str):
        key = (name, dtype)
        if key not in self.engines:
            if name != SMOLLM2:  # the other big one goes before this one loads
                for other in [k for k in self.engines if k[0] != SMOLLM2]:
                    del self.engines[other]
                gc.collect()
            import dflash2

            self.engines[key] = dflash2.load(name, drafter="none", dtype=dtype, device="cpu")
        return self.engines[key]

    def cache_clear(self) -> None:
        self.engines.clear()
        gc.collect()


lean_engine = _EngineCache()
