"""KV caches. No imports from models/, drafters/ or decode/.

Both caches keep the keys/values of one sequence's committed slots ``[0, length)`` and implement the commit side
of a verification the same way (:class:`KVCommit`): ``rollback`` keeps a prefix (a chain's accepted drafts),
``compact`` moves a verified tree's accepted branch into consecutive slots. ``decode.step.commit_kept``
commits any loop's outcome through it.
"""

from typing import Protocol

import torch

from dflash2.kv.static import StaticKVCache


class KVCommit(Protocol):
    length: int  # committed slots

    def rollback(self, length: int) -> None: ...

    def compact(self, source_slots: torch.Tensor, destination: int) -> None: ...


__all__ = ["KVCommit", "StaticKVCache"]
