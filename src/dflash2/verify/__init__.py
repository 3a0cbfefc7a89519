"""Pure verification math: no model imports. p_target / q_draft as in the glossary (docs/glossary.md)."""

from dflash2.verify.greedy import PAD_ID, ChainVerdict, verify_greedy
from dflash2.verify.rejection import verify_chain
from dflash2.verify.sampling import GREEDY, SamplingParams, choose_token, logits_to_probs, sample
from dflash2.verify.tree import (
    TreeLayout,
    TreeVerdict,
    canonical_paths,
    compile_tree,
    target_positions,
    tree_attention_mask,
    tree_from_paths,
    verify_tree,
    verify_tree_greedy,
)

__all__ = [
    "GREEDY",
    "PAD_ID",
    "ChainVerdict",
    "SamplingParams",
    "TreeLayout",
    "TreeVerdict",
    "canonical_paths",
    "choose_token",
    "compile_tree",
    "logits_to_probs",
    "sample",
    "target_positions",
    "tree_attention_mask",
    "tree_from_paths",
    "verify_chain",
    "verify_greedy",
    "verify_tree",
    "verify_tree_greedy",
]
