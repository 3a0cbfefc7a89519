"""The ``dflash2`` drafter: a pretrained small model of the target's family (the PARD drafter: LoRA adapters and a
learned mask embedding, k drafts in ONE pass) that also reads the target's hidden states of the last verified
position from a few of its layers (``drafters/conditioning.py``), added to the inputs of the pass's drafting rows.

Everything else is the PARD drafter's (drafters/pard.py): its own KV cache of the committed ids, rollback, the
context window, trees (``dflash2:kxW``), the draft vocabulary and Q8_0 / Q4_0 weights. What it adds:

- ``hidden_layers`` = the conditioning's target layers: the engine then hands it, after prefill and after every
  verification, the target's states of the positions just committed (``observe``); the drafter keeps the
  conditioning of the LAST one (position ``len(sequence) - 2``: the pending token has no state yet).
- a draft pass adds that offset to the input embeddings of the pending row and the mask rows; ids read as
  context get none (as in training: ``train/pard_objective.block_offsets``), unless the conditioning reads every
  context position (``ConditioningConfig.context``): then the id at position p is read with the offset of the
  target's state at p - 1, kept from the observation that brought it (``train/pard_objective.context_offsets``).

Lossless as every drafter: the conditioning changes which tokens are drafted, never what is verified. At T > 0
each position is sampled from its own ``q_draft`` (given the same inputs whatever the drafts before it). Where the
offset does not match the sequence (a draft after steps the drafter did not observe), the pass drafts without it.
Lead tokens (``pard:L+k``) are not offered: a lead token has no target state for the pass after it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2.drafters.conditioning import TargetConditioning, fuse_taps, has_conditioning
from dflash2.drafters.pard import PARD_CONFIG
from dflash2.drafters.model import ContextWindow
from dflash2.drafters.target_reading import TargetReadingPardDrafter
from dflash2.models.decoder import Transformer


class ConditionedPardDrafter(TargetReadingPardDrafter):
    """PARD drafting with the target's hidden states of the last verified position (module docstring)."""

    name = "dflash2"

    def __init__(self, model: Transformer, mask_token_id: int, conditioning: TargetConditioning,
                 num_draft_tokens: int = 8, target_vocab_size: int | None = None, num_paths: int = 1,
                 context_window: ContextWindow | tuple[int, int] | None = None, catch_up: int | None = None,
                 reader: Transformer | None = None) -> None:
        super().__init__(model, mask_token_id, conditioning, num_draft_tokens, target_vocab_size, num_paths,
                         context_window, catch_up, reader)
        self._offset: torch.Tensor | None = None  # [D] in the drafter's dtype
        self._offset_position = -1  # the position whose target state made it
        # every context position (conditioning.config.context): row p holds the offset of the id at position p
        # (from the target's state at p - 1) where ``_have_offset[p]``
        self._row_offsets: torch.Tensor | None = None  # [capacity + extra_slots + 1, D]
        self._have_offset: torch.Tensor | None = None  # [capacity + extra_slots + 1] bool

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self._offset, self._offset_position = None, -1
        if self.conditioning.config.context:
            rows = capacity + self.extra_slots + 1  # (a pass's mask rows lie past the committed ids)
            if self._row_offsets is None or self._row_offsets.shape[0] < rows:
                self._row_offsets = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype,
                                                device=self.model.device)
                self._have_offset = torch.zeros(rows, dtype=torch.bool, device=self.model.device)
            self._have_offset.zero_()

    @torch.inference_mode()
    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """Keep the conditioning of the last committed position's target state (each tap [1, n, Dt]), and with
        context conditioning that of every observed position whose id a pass may still read."""
        if not target_hidden or target_hidden[0].shape[1] == 0:
            return
        last = len(sequence) - 2  # the observed positions are last - n + 1 .. last
        if not self.conditioning.config.context:
            state = fuse_taps(tuple(h[0, -1:] for h in target_hidden))  # [1, T * Dt]
            self._offset = self.conditioning(state)[0].to(self.model.dtype)  # [D]
            self._offset_position = last
            return
        if num_accepted == -1:  # a new context (a prompt's first chunk): what was observed before is not its
            self._have_offset.zero_()
        first = last - target_hidden[0].shape[1] + 1
        rows = self._positions_to_keep(first, last)  # [r] target positions p; their offsets go to row p + 1
        states = fuse_taps(tuple(h[0, rows - first] for h in target_hidden))  # [r, T * Dt]
        self._row_offsets[rows + 1] = self.conditioning(states).to(self.model.dtype)
        self._have_offset[rows + 1] = True
        self._offset = self._row_offsets[last + 1]
        self._offset_position = last

    def _read_offsets(self, positions: list[int]) -> torch.Tensor | None:
        """[1, n, D] the offsets of the ids read at ``positions`` (zero where none was observed), or None without
        context conditioning."""
        if not self.conditioning.config.context:
            return None
        index = torch.tensor(positions, device=self.model.device)
        offsets = self._row_offsets[index] * self._have_offset[index, None]  # [n, D]
        return offsets[None]

    def _pass_hidden(self, sequence: list[int], num_draft_tokens: int) -> torch.Tensor:
        """One draft pass with the offset on its drafting rows -> [k, D] (before the final norm)."""
        feed = self._prepare_pass(sequence, num_draft_tokens)
        device = self.model.device
        offsets = self._read_offsets(feed.positions)  # [1, T, D] (None without context conditioning)
        if self._offset is not None and self._offset_position == len(sequence) - 2:
            if offsets is None:
                offsets = torch.zeros(1, len(feed.ids), self.model.config.hidden_size, dtype=self.model.dtype,
                                      device=device)  # [1, T, D]
            offsets[0, feed.draft_rows] = self._offset.to(device)
        out = self.model(torch.tensor([feed.ids], device=device), torch.tensor([feed.positions], device=device),
                         cache=self.cache, hidden_layers=(self.model.config.num_layers - 1,), logits="none",
                         input_offsets=offsets)
        hidden = out.hidden_states[0][0, feed.draft_rows]  # [k, D]
        self._finish_pass(sequence, feed)
        return hidden


def build_conditioned_drafter(target, draft_model: str | Path | None, num_draft_tokens: int | None, *,
                              dtype: str = "bf16", weights: str | None = None, pull: bool = True,
                              num_paths: int = 1) -> ConditionedPardDrafter:
    """The ``dflash2`` drafter for ``target`` (a :class:`~dflash2.drafters.DraftTarget`): ``draft_model`` is a
    trained adapter directory with its conditioning (``pard_config.json`` + ``conditioning.json``, or
    ``kv_conditioning.json``: gated keys / values, ``drafters/kv_conditioned.py``); None = the one
    shipped for the target (``drafters/trained/<target>-dflash2-conditioned``, none yet). The network loads as the
    PARD drafter's (:func:`~dflash2.drafters.pard.build_pard_drafter`: weight format, draft vocabulary, prompt
    reader)."""
    from dflash2.drafters.pard import SHIPPED_DIR, build_pard_drafter
    from dflash2.models.store import canonical_name

    if draft_model is None:
        draft_model = SHIPPED_DIR / f"{canonical_name(target.name) or target.name}-dflash2-conditioned"
    from dflash2.drafters.kv_conditioned import KVConditionedPardDrafter
    from dflash2.drafters.kv_conditioning import GatedKVConditioning, has_kv_conditioning

    directory = Path(draft_model)
    keys_values = has_kv_conditioning(directory)
    if not ((directory / PARD_CONFIG).exists() and (has_conditioning(directory) or keys_values)):
        raise ValueError(f"no target-conditioned drafter in {directory}: train one with `dflash2 train pard "
                         f"--features DIR --condition` (or `--condition-kv`) and pass its drafter/ directory as "
                         f"--draft-model")
    pard = build_pard_drafter(target, directory, num_draft_tokens, dtype=dtype, weights=weights, pull=pull,
                              num_paths=num_paths)
    if keys_values:
        kv = GatedKVConditioning.load(directory).to(pard.model.device)
        _check_target_width(directory, kv.config.target_hidden_size, target)
        return KVConditionedPardDrafter(pard.model, pard.mask_token_id, kv, pard.num_draft_tokens,
                                        pard.target_vocab_size, num_paths, pard.context_window, pard.catch_up,
                                        pard.reader)
    conditioning = TargetConditioning.load(directory).to(pard.model.device)
    _check_target_width(directory, conditioning.config.target_hidden_size, target)
    return ConditionedPardDrafter(pard.model, pard.mask_token_id, conditioning, pard.num_draft_tokens,
                                  pard.target_vocab_size, num_paths, pard.context_window, pard.catch_up, pard.reader)


def _check_target_width(directory: Path, width: int, target) -> None:
    if width != target.target.config.hidden_size:
        raise ValueError(f"{directory} reads a target of width {width}, not {target.target.config.hidden_size}")
