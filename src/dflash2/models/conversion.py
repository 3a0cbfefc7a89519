"""What names a GGUF's conversion without running one: the dtypes a model is converted to (and their aliases) and
the converter's version. ``gguf_convert`` converts with them; the model store lists, resolves and checks converted
directories with them alone, without importing torch (``dflash2 models list`` answers at once)."""

from __future__ import annotations

# Bumped whenever the converted output changes, so cached conversions made by an older converter are redone.
CONVERTER_VERSION = 1

DTYPE_NAMES = ("bf16", "fp16", "fp32")
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32",
}  # fmt: skip


def normalize_dtype(dtype: str) -> str:
    """'bf16' | 'fp16' | 'fp32' (also accepts 'bfloat16', 'float32', ...); raises ValueError otherwise."""
    key = _DTYPE_ALIASES.get(str(dtype).lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return key
