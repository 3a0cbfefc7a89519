"""dflash2: lossless speculative decoding for LLMs.

    import dflash2
    engine = dflash2.load()                      # Qwen2.5-Coder-1.5B-Instruct, bf16
    result = engine.generate("Write a prime checker in Python.", max_new_tokens=128)
    print(result.text, result.stats.tokens_per_s)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash2.lazy import lazy_names

__all__ = ["DecodeStats", "Engine", "GenerationResult", "SamplingParams", "StreamChunk", "load"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from dflash2.api import load
    from dflash2.decode.engine import Engine
    from dflash2.decode.output import GenerationResult, StreamChunk
    from dflash2.decode.stats import DecodeStats
    from dflash2.verify.sampling import SamplingParams

__getattr__ = lazy_names(__name__, {
    "load": "dflash2.api", "Engine": "dflash2.decode.engine", "GenerationResult": "dflash2.decode.output",
    "StreamChunk": "dflash2.decode.output", "DecodeStats": "dflash2.decode.stats",
    "SamplingParams": "dflash2.verify.sampling"}, globals())
