"""The ``dflash2`` drafter with gated key / value conditioning (``drafters/kv_conditioning.py``): the PARD drafter
(the pretrained small model with its LoRA adapter and learned mask, k drafts in ONE pass) whose drafting rows also
look up, in every layer, the target's hidden states of every verified position.

Everything else is the PARD drafter's (drafters/pard.py): its own KV cache of the committed ids, rollback, the
context window, the draft vocabulary, Q8_0 / Q4_0 weights. What it adds:

- ``hidden_layers`` = the conditioning's target layers: the engine hands it, after prefill and after every
  verification, the target's states of the positions just committed (``observe``). It maps them to context
  states once and keeps, per drafter layer, their keys (rotated at their positions) and values in a cache of its
  own, indexed by position as the drafter's cache is (a rollback needs nothing: a position not yet observed
  again is not read).
- a draft pass's drafting rows (the pending token and the masks) attend to those keys and values of the positions
  before the pending token (``GatedTargetAttention``), each layer's lookup added times its gate; the ids the pass
  reads as context get no lookup, as in training (``train/pard_objective.block_hidden``).

Past a long prompt's context window only the sink's and the recent positions' states are kept, as the drafter
reads only those ids. Lossless as every drafter: the lookup changes which tokens are drafted, never what is
verified; at T > 0 each position is sampled from its own ``q_draft``. Lead tokens are not offered (a lead token has
no target state for the pass after it).
"""

from __future__ import annotations

import torch

from dflash2.drafters.conditioning import fuse_taps
from dflash2.drafters.kv_conditioning import GatedKVConditioning, GatedTargetAttention
from dflash2.drafters.model import ContextWindow
from dflash2.drafters.target_reading import TargetReadingPardDrafter
from dflash2.models.decoder import CachedAttention, Transformer


class KVConditionedPardDrafter(TargetReadingPardDrafter):
    """PARD drafting whose drafting rows look up the target's states of every verified position (module doc)."""

    name = "dflash2"

    def __init__(self, model: Transformer, mask_token_id: int, conditioning: GatedKVConditioning,
                 num_draft_tokens: int = 8, target_vocab_size: int | None = None, num_paths: int = 1,
                 context_window: ContextWindow | tuple[int, int] | None = None, catch_up: int | None = None,
                 reader: Transformer | None = None) -> None:
        super().__init__(model, mask_token_id, conditioning, num_draft_tokens, target_vocab_size, num_paths,
                         context_window, catch_up, reader)
        self._keys: torch.Tensor | None = None  # [L, 1, H_kv, slots, Dh]: the target states' keys, by position
        self._values: torch.Tensor | None = None  # [L, 1, H_kv, slots, Dh]
        self._observed: torch.Tensor | None = None  # [slots] bool: which positions hold an observed state

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        slots = capacity + self.extra_slots + 1
        if self._observed is None or self._observed.shape[0] < slots:
            c = self.model.config
            shape = (c.num_layers, 1, c.num_kv_heads, slots, c.head_dim)
            self._keys = torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
            self._values = torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
            self._observed = torch.zeros(slots, dtype=torch.bool, device=self.model.device)
        self._observed.zero_()

    @torch.inference_mode()
    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """Keep every layer's keys and values of the observed positions' target states (each tap [1, n, Dt], the
        positions ``len(sequence) - 1 - n .. len(sequence) - 2``: the pending token has no state yet)."""
        if not target_hidden or target_hidden[0].shape[1] == 0:
            return
        if num_accepted == -1:  # a new context (a prompt's first chunk): what was observed before is not its
            self._observed.zero_()
        last = len(sequence) - 2
        first = last - target_hidden[0].shape[1] + 1
        positions = self._positions_to_keep(first, last)  # [r]
        states = self.conditioning.context_states(fuse_taps(tuple(h[0, positions - first] for h in target_hidden)))
        rope = self.model.rope(positions[None])
        for layer in range(self.model.config.num_layers):
            keys, values = self.conditioning.layer_keys_values(self.model, layer, states[None], rope)
            self._keys[layer, :, :, positions] = keys  # [1, H_kv, r, Dh]
            self._values[layer, :, :, positions] = values
        self._observed[positions] = True

    def _pass_hidden(self, sequence: list[int], num_draft_tokens: int) -> torch.Tensor:
        """One draft pass whose drafting rows look up the target's states -> [k, D] (before the final norm)."""
        feed = self._prepare_pass(sequence, num_draft_tokens)
        device = self.model.device
        verified = len(sequence) - 1  # target positions 0 .. verified - 1 may hold states
        visible = torch.zeros(1, len(feed.ids), verified, dtype=torch.bool, device=device)  # [1, T, S]
        visible[0, feed.draft_rows] = self._observed[:verified]

        def keys_values(layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # each [1, H_kv, S, Dh]
            return self._keys[layer, :, :, :verified], self._values[layer, :, :, :verified]

        context = GatedTargetAttention(self.conditioning.gates, CachedAttention(self.cache, None), keys_values,
                                       visible)
        out = self.model(torch.tensor([feed.ids], device=device), torch.tensor([feed.positions], device=device),
                         cache=self.cache, hidden_layers=(self.model.config.num_layers - 1,), logits="none",
                         context=context)
        hidden = out.hidden_states[0][0, feed.draft_rows]  # [k, D]
        self._finish_pass(sequence, feed)
        return hidden
