"""A cost model of one speculative step, sync vs overlapped: what overlap can gain, from measured times.

Per target pass (one step), with times measured when each side runs alone:
- sync:    ``T_sync = D + V``: draft the block (D), then verify it (V); each side idles while the other works.
- overlap: ``T_overlap = max(s_V * V, s_D * A) + (1 - h) * D``. While the target verifies, the drafter pre-drafts
  ahead (A: the bonus guess + the next block, about D * (k + 1) / k); on a hit (rate h) the next verification
  starts at once, on a miss the target waits for a fresh draft (D). ``s_V``, ``s_D`` >= 1 are the slowdowns of
  each side while both run: on a 2-core CPU they share cores and memory bandwidth (measured about 1.3 - 2),
  on a GPU with the drafter on its own stream they are close to 1 (a batch-1 target leaves most SMs idle).
Tokens per pass (tau) are the same in both pipelines, so the speedup is ``T_sync / T_overlap``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    draft_s: float  # D: drafting one block alone (seconds)
    verify_s: float  # V: one verification pass alone (seconds)
    hit_rate: float  # h: share of steps whose pre-draft matched the outcome (all accepted, bonus guessed)
    ahead_s: float | None = None  # A: pre-drafting one block ahead alone; None: D * (k + 1) / k
    num_draft_tokens: int = 4  # k, for the default A
    target_slowdown: float = 1.0  # s_V: verification time while the drafter runs / alone
    drafter_slowdown: float = 1.0  # s_D: drafting time while the target runs / alone

    @property
    def ahead(self) -> float:
        if self.ahead_s is not None:
            return self.ahead_s
        return self.draft_s * (self.num_draft_tokens + 1) / self.num_draft_tokens

    def sync_step(self) -> float:
        return self.draft_s + self.verify_s

    def overlap_step(self) -> float:
        concurrent = max(self.target_slowdown * self.verify_s, self.drafter_slowdown * self.ahead)
        return concurrent + (1.0 - self.hit_rate) * self.draft_s

    def overlap_speedup(self) -> float:
        """Predicted tokens/s of overlap over sync (> 1: overlap wins)."""
        return self.sync_step() / self.overlap_step()


def break_even_slowdown(costs: StepCosts) -> float:
    """The common slowdown s = s_V = s_D at which overlap stops paying (speedup 1)."""
    concurrent = max(costs.verify_s, costs.ahead)
    return (costs.sync_step() - (1.0 - costs.hit_rate) * costs.draft_s) / concurrent
