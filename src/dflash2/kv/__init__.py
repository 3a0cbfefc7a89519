"""KV caches. No imports from models/, drafters/ or decode/."""

from dflash2.kv.static import StaticKVCache

__all__ = ["StaticKVCache"]
