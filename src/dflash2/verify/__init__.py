"""Pure verification math: no model imports. p_target / q_draft as in the glossary (docs/glossary.md)."""

from dflash2.verify.sampling import GREEDY, SamplingParams, choose_token, logits_to_probs, sample

__all__ = ["GREEDY", "SamplingParams", "choose_token", "logits_to_probs", "sample"]
