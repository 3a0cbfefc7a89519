"""What the target-conditioned PARD drafters share (``drafters/conditioned.py``: input offsets;
``drafters/kv_conditioned.py``: gated keys and values): the conditioning, the target layers the engine hands them
after every verification (``observe``), one pass per request, and which observed positions they keep past a long
prompt's context window."""

from __future__ import annotations

import torch

from dflash2.drafters.model import ContextWindow
from dflash2.drafters.pard import PardDrafter
from dflash2.models.decoder import Transformer


class TargetReadingPardDrafter(PardDrafter):
    """What the conditioned PARD drafters share: the conditioning, the target layers the engine hands them
    (``observe``), one pass per request, and which observed positions past a context window they keep."""

    def __init__(self, model: Transformer, mask_token_id: int, conditioning, num_draft_tokens: int = 8,
                 target_vocab_size: int | None = None, num_paths: int = 1,
                 context_window: ContextWindow | tuple[int, int] | None = None, catch_up: int | None = None,
                 reader: Transformer | None = None) -> None:
        super().__init__(model, mask_token_id, num_draft_tokens, target_vocab_size, num_paths, context_window,
                         catch_up, 0, reader)
        self.conditioning = conditioning
        self.hidden_layers = conditioning.config.target_layers

    def for_request(self) -> TargetReadingPardDrafter:
        """The same networks (weights shared), its own caches."""
        return type(self)(self.model, self.mask_token_id, self.conditioning, self.num_draft_tokens,
                          self.target_vocab_size, self.num_paths, self.context_window, self.catch_up, self.reader)

    def shared_pass(self, sequence: list[int], num_draft_tokens: int) -> None:
        """Each request's pass reads its own target states: drafted one by one (``propose``)."""
        return None

    def _positions_to_keep(self, first: int, last: int) -> torch.Tensor:
        """The observed positions a pass may read: all, or past a context window's reach only its sink and its
        recent ids (a long prompt: mapping every position would cost more than the drafter's read)."""
        device = self.model.device
        if self.context_window is None or not self.context_window.applies(last - first + 1 - 8):
            return torch.arange(first, last + 1, device=device)
        sink, recent = self.context_window.sink, self.context_window.recent
        head = torch.arange(first, min(sink, last + 1), device=device)
        tail = torch.arange(max(first, last - recent - 8), last + 1, device=device)
        return torch.unique(torch.cat([head, tail]))
