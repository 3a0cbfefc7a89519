"""Greedy chain verification (temperature 0) and the verdict type shared with chain rejection sampling.

A chain step proposes ``k`` draft tokens ``x_0 .. x_{k-1}``; the target scores ``k + 1`` positions.
Position ``i`` of the target's output is its distribution for the token after draft ``i - 1`` (position 0
follows the last committed token). Greedy verification keeps drafts while they equal the target's argmax,
then emits the argmax at the first mismatch (the recovered token) or at position ``k`` (the bonus token).
The emitted tokens are exactly those plain greedy decoding would produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.verify.sampling import greedy_ids

PAD_ID = -1  # fills ChainVerdict.tokens after the recovered-or-bonus token


@dataclass
class ChainVerdict:
    """Outcome of verifying one chain of drafts per batch row."""

    num_accepted: torch.Tensor  # [batch] int64, drafts accepted (0..k)
    tokens: torch.Tensor  # [batch, k + 1] int64: accepted drafts, then the recovered-or-bonus token, then PAD_ID

    @property
    def num_emitted(self) -> torch.Tensor:
        """Tokens committed this step per row, recovered/bonus included: [batch] int64."""
        return self.num_accepted + 1

    def emitted(self, row: int) -> list[int]:
        """The tokens committed for one batch row, without padding."""
        count = int(self.num_accepted[row]) + 1
        return self.tokens[row, :count].tolist()


def verify_greedy(
    draft_ids: torch.Tensor,  # [batch, k] int64
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
) -> ChainVerdict:
    """Accept drafts while each equals the target's argmax; emit the argmax after the last accepted one."""
    check_chain_inputs(draft_ids, target_logits, "target_logits")
    draft_ids = draft_ids.long()
    target_ids = greedy_ids(target_logits)  # [batch, k + 1]
    k = draft_ids.shape[1]
    matches = draft_ids == target_ids[:, :k]  # [batch, k]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [batch]
    final_token = target_ids.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
    return ChainVerdict(num_accepted=num_accepted, tokens=chain_tokens(draft_ids, num_accepted, final_token))


def chain_tokens(
    draft_ids: torch.Tensor,  # [batch, k] int64
    num_accepted: torch.Tensor,  # [batch] int64
    final_token: torch.Tensor,  # [batch] int64, the recovered-or-bonus token
) -> torch.Tensor:
    """Assemble ChainVerdict.tokens: [batch, k + 1] = accepted drafts, final token, PAD_ID after it."""
    batch, k = draft_ids.shape
    column = torch.arange(k + 1, device=draft_ids.device)  # [k + 1]
    padded_drafts = torch.cat([draft_ids, draft_ids.new_full((batch, 1), PAD_ID)], dim=1)  # [batch, k + 1]
    n = num_accepted[:, None]  # [batch, 1]
    tokens = torch.where(column < n, padded_drafts, PAD_ID)  # [batch, k + 1]
    return torch.where(column == n, final_token[:, None], tokens)


def check_chain_inputs(
    draft_ids: torch.Tensor,  # [batch, k] int64
    target: torch.Tensor,  # [batch, k + 1, vocab] logits or probabilities
    name: str,
) -> None:
    """Raise ValueError on mismatched shapes, a non-integer draft dtype or draft ids outside [0, vocab)."""
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [batch, k], got shape {tuple(draft_ids.shape)}")
    if draft_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_ids must be an integer tensor, got {draft_ids.dtype}")
    batch, k = draft_ids.shape
    if target.dim() != 3 or target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(f"{name} must be [batch={batch}, k + 1={k + 1}, vocab], got shape {tuple(target.shape)}")
    vocab = target.shape[2]
    if draft_ids.numel() and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab):
        raise ValueError(f"draft ids must lie in [0, {vocab}), got min {int(draft_ids.min())} max {int(draft_ids.max())}")
