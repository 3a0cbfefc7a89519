"""Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised over the batch.

For draft ``x_i`` drawn from ``q_draft[:, i]`` the target accepts with probability
``min(1, p_target(x_i) / q_draft(x_i))``. At the first rejection it emits the recovered token, drawn from the
residual ``norm(max(p_target - q_draft, 0))`` at that position (``p_target`` itself when the residual is all
zero), and stops. When every draft is accepted it emits a bonus token drawn from ``p_target[:, k]``. The
emitted tokens are then distributed exactly as tokens sampled from the target one at a time.

A deterministic drafter (n-gram, greedy block drafter) is the special case ``q_draft = one-hot(x_i)``: accept
with probability ``p_target(x_i)``; the residual is ``p_target`` with ``x_i`` removed. Pass ``q_draft=None``
for it. Never compare drafts to the target's argmax at temperature > 0: that is not lossless.
"""

from __future__ import annotations

import torch

from dflash2.verify.greedy import ChainVerdict, chain_tokens, check_chain_inputs
from dflash2.verify.sampling import sample

__all__ = ["ChainVerdict", "verify_chain"]  # ChainVerdict is defined in greedy.py and re-exported here


def verify_chain(
    draft_ids: torch.Tensor,  # [batch, k] int64
    p_target: torch.Tensor,  # [batch, k + 1, vocab] float32, already warped (logits_to_probs)
    q_draft: torch.Tensor | None,  # [batch, k, vocab] float32, what each draft was sampled from; None = one-hot
    generator: torch.Generator,
    *,
    uniforms: torch.Tensor | None = None,  # [batch, k] in [0, 1]: draft i accepted iff u_i * q(x_i) < p(x_i)
) -> ChainVerdict:
    """Exact rejection sampling of a chain of drafts. Random draws: the uniforms (unless given), then one
    multinomial draw per row for the recovered-or-bonus token, all from ``generator``."""
    check_chain_inputs(draft_ids, p_target, "p_target")
    draft_ids = draft_ids.long()
    batch, k = draft_ids.shape
    vocab = p_target.shape[2]
    if q_draft is not None and tuple(q_draft.shape) != (batch, k, vocab):
        raise ValueError(f"q_draft must be [batch={batch}, k={k}, vocab={vocab}], got {tuple(q_draft.shape)}")
    if uniforms is None:
        uniforms = torch.rand((batch, k), generator=generator, device=p_target.device)
    elif tuple(uniforms.shape) != (batch, k):
        raise ValueError(f"uniforms must be [batch={batch}, k={k}], got {tuple(uniforms.shape)}")

    # Acceptance test: u < p / q, written without the division so that q(x) == 0 < p(x) accepts.
    p_at_draft = p_target[:, :k].gather(2, draft_ids[..., None]).squeeze(2)  # [batch, k]
    if q_draft is None:
        accepted = uniforms < p_at_draft  # [batch, k]
    else:
        q_at_draft = q_draft.gather(2, draft_ids[..., None]).squeeze(2)  # [batch, k]
        accepted = uniforms * q_at_draft < p_at_draft  # [batch, k]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [batch]; acceptances after a rejection ignored

    rows = torch.arange(batch, device=draft_ids.device)  # [batch]
    p_final = p_target[rows, num_accepted]  # [batch, vocab]: at the first rejection, or at k for the bonus
    if k == 0:
        final_dist = p_final
    else:
        at = num_accepted.clamp(max=k - 1)  # [batch], the rejected draft's position (clamped for bonus rows)
        if q_draft is None:  # max(p - one_hot(x), 0) is p with x removed
            residual = p_final.scatter(1, draft_ids[rows, at][:, None], 0.0)  # [batch, vocab]
        else:
            residual = (p_final - q_draft[rows, at]).clamp_min(0.0)  # [batch, vocab]
        use_residual = (num_accepted < k) & (residual.sum(dim=1) > 0)  # [batch]
        final_dist = torch.where(use_residual[:, None], residual, p_final)  # [batch, vocab], unnormalised
    final_token = sample(final_dist, generator)  # [batch]; multinomial normalises the weights
    return ChainVerdict(num_accepted=num_accepted, tokens=chain_tokens(draft_ids, num_accepted, final_token))
