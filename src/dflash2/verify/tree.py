"""Tree verification (SpecInfer, EAGLE, Medusa): one target forward scores a whole tree of drafts.

A tree is plain data: ``parents[i]`` is the parent node of draft node ``i`` (-1 = a child of the root), parents
before children. ``compile_tree`` turns it, once, into what the target forward and the verifier need.

The verify input is ``[root_token, node_0 .. node_{n-1}]``: index 0 is the root (the last committed token,
not yet in the cache), index ``i + 1`` is node ``i``. Its position is ``prefix_len + depth``; it attends to the
prefix, its ancestors and itself. The target's distribution at input index ``j`` is over the children of ``j``.

Verification walks down from the root, at each step either following one child (an accepted draft) or
emitting a token that is not in the tree (recovered) or below a leaf (bonus), which ends the step:
- greedy: follow the child equal to the target's argmax.
- deterministic children (``q_draft=None``): draw ``y ~ p_target``, follow the child equal to ``y``, else emit ``y``.
- sampled children (``q_draft`` given; the children of a position drawn from it without replacement, in order):
  recursive rejection sampling. Try the children in order, accept ``c`` with probability ``min(1, p(c) / q(c))``;
  on rejection ``p := norm(max(p - q, 0))`` and ``q := q`` with ``c`` removed, renormalised; if no child is
  accepted, emit a draw from the final ``p``. Every variant emits tokens distributed exactly as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash2.verify.sampling import greedy_ids, sample


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """A tree's shape compiled for one verify forward (build with ``compile_tree``)."""

    parents: torch.Tensor  # [n] int64, parent node index of each draft node, -1 = child of the root
    depth: torch.Tensor  # [n + 1] int64, depth of each verify-input position (root = 0)
    attn_mask: torch.Tensor  # [n + 1, n + 1] bool, True = may attend: ancestors and itself
    children: tuple[tuple[int, ...], ...]  # per verify-input position (0 = root, i + 1 = node i): child nodes in order

    @property
    def num_nodes(self) -> int:
        """n, the number of draft nodes (the verify input has n + 1 positions)."""
        return int(self.parents.shape[0])


@dataclass
class TreeVerdict:
    """Outcome of verifying one tree."""

    accepted_nodes: list[int]  # node indices along the accepted path, root excluded, in order
    tokens: torch.Tensor  # [len(accepted_nodes) + 1] int64: accepted drafts then the recovered-or-bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def kept_positions(self) -> list[int]:
        """Verify-input indices on the accepted path, root included (whose KV entries to keep)."""
        return [0] + [node + 1 for node in self.accepted_nodes]


def compile_tree(parents: Sequence[int]) -> TreeLayout:
    """Validate a parents list (each parent is -1 or an earlier node) and build the layout."""
    parents = [int(parent) for parent in parents]
    n = len(parents)
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: parents must be -1 or an earlier node index")
    depth = [0] * (n + 1)
    attn_mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [n + 1, n + 1]
    attn_mask[0, 0] = True
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for node, parent in enumerate(parents):
        position, parent_position = node + 1, parent + 1
        depth[position] = depth[parent_position] + 1
        attn_mask[position] = attn_mask[parent_position]  # the parent's ancestors (and the parent) ...
        attn_mask[position, position] = True  # ... and itself
        children[parent_position].append(node)
    return TreeLayout(
        parents=torch.tensor(parents, dtype=torch.int64),
        depth=torch.tensor(depth, dtype=torch.int64),
        attn_mask=attn_mask,
        children=tuple(tuple(c) for c in children),
    )


def canonical_paths(paths: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The node order ``tree_from_paths`` uses: by depth, then by ranks (siblings in rank order).

    A path is the list of token-choice ranks from the root, e.g. ``(0, 1)`` = the second choice after the first
    choice. Raises ValueError on empty or duplicate paths, negative ranks, or a path whose parent path is missing.
    """
    ordered = sorted((tuple(int(rank) for rank in path) for path in paths), key=lambda path: (len(path), path))
    seen: set[tuple[int, ...]] = set()
    for path in ordered:
        if not path:
            raise ValueError("empty path: the root is implicit")
        if min(path) < 0:
            raise ValueError(f"path {path} has a negative rank")
        if path in seen:
            raise ValueError(f"duplicate path {path}")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"path {path} has no parent path {path[:-1]}")
        seen.add(path)
    return ordered


def tree_from_paths(paths: Sequence[Sequence[int]]) -> list[int]:
    """Medusa-style paths of ranks -> parents list; node i is ``canonical_paths(paths)[i]``."""
    ordered = canonical_paths(paths)
    index = {path: node for node, path in enumerate(ordered)}
    return [index[path[:-1]] if len(path) > 1 else -1 for path in ordered]


def target_positions(layout: TreeLayout, prefix_len: int) -> torch.Tensor:
    """Position ids of the verify input: [n + 1] int64 = prefix_len + depth."""
    return layout.depth + prefix_len


def tree_attention_mask(layout: TreeLayout, prefix_len: int) -> torch.Tensor:
    """[n + 1, prefix_len + n + 1] bool, True = may attend: the whole prefix, then the tree mask."""
    prefix = torch.ones(layout.num_nodes + 1, prefix_len, dtype=torch.bool)  # [n + 1, prefix_len]
    return torch.cat([prefix, layout.attn_mask], dim=1)


def verify_tree_greedy(
    layout: TreeLayout,
    node_tokens: torch.Tensor,  # [n] int64, the draft token of each node
    target_logits: torch.Tensor,  # [n + 1, vocab], row j = target's logits for the children of input index j
) -> TreeVerdict:
    """Follow the child equal to the target's argmax; emit the argmax where no child matches."""
    tokens = _check_tree_inputs(layout, node_tokens, target_logits, "target_logits")  # [n]
    target_ids = greedy_ids(target_logits).tolist()  # [n + 1]
    accepted: list[int] = []
    position = 0
    while True:
        wanted = target_ids[position]
        child = next((c for c in layout.children[position] if tokens[c] == wanted), None)
        if child is None:
            return _verdict(accepted, tokens, wanted)
        accepted.append(child)
        position = child + 1


def verify_tree(
    layout: TreeLayout,
    node_tokens: torch.Tensor,  # [n] int64, the draft token of each node
    p_target: torch.Tensor,  # [n + 1, vocab] float32, warped; row j = target's distribution for j's children
    q_draft: torch.Tensor | None,  # [n + 1, vocab] float32, what j's children were drawn from; None = deterministic
    generator: torch.Generator,
    *,
    uniforms: torch.Tensor | None = None,  # [n] in [0, 1]: node c accepted iff u_c * q(c) < p(c) (q_draft given)
) -> TreeVerdict:
    """Exact (lossless) sampling verification of a draft tree; see the module docstring for the rules."""
    tokens = _check_tree_inputs(layout, node_tokens, p_target, "p_target")  # [n]
    n = layout.num_nodes
    if q_draft is not None and tuple(q_draft.shape) != tuple(p_target.shape):
        raise ValueError(f"q_draft must have p_target's shape {tuple(p_target.shape)}, got {tuple(q_draft.shape)}")
    if q_draft is not None and uniforms is None:
        uniforms = torch.rand(n, generator=generator, device=p_target.device)
    if uniforms is not None and tuple(uniforms.shape) != (n,):
        raise ValueError(f"uniforms must be [n={n}], got {tuple(uniforms.shape)}")
    u = uniforms.tolist() if uniforms is not None else []  # [n]
    accepted: list[int] = []
    position = 0
    while True:
        children = layout.children[position]
        p = p_target[position]  # [vocab]
        if q_draft is None or not children:
            emitted = int(sample(p, generator))
            child = next((c for c in children if tokens[c] == emitted), None)
        else:
            child, p = _recursive_rejection(children, tokens, u, p, q_draft[position])
            emitted = tokens[child] if child is not None else int(sample(p, generator))
        if child is None:
            return _verdict(accepted, tokens, emitted)
        accepted.append(child)
        position = child + 1


def _recursive_rejection(
    children: tuple[int, ...],
    tokens: list[int],
    uniforms: list[float],
    p: torch.Tensor,  # [vocab], the target's distribution at the parent
    q: torch.Tensor,  # [vocab], the distribution the first child was drawn from
) -> tuple[int | None, torch.Tensor]:
    """Try the children in order; return (accepted child or None, the residual to sample from if None)."""
    for child in children:
        x = tokens[child]
        p_x, q_x = float(p[x]), float(q[x])
        if uniforms[child] * q_x < p_x:  # probability min(1, p(x) / q(x)); q(x) == 0 < p(x) accepts
            return child, p
        residual = (p - q).clamp_min(0.0)  # [vocab]
        mass = float(residual.sum())
        if mass > 0:  # else p == q: keep p (the fallback)
            p = residual / mass
        q = q.clone()
        q[x] = 0.0  # the next child was drawn without replacement
        q_mass = float(q.sum())
        if q_mass > 0:
            q = q / q_mass
    return None, p


def _verdict(accepted: list[int], tokens: list[int], final_token: int) -> TreeVerdict:
    emitted = [tokens[node] for node in accepted] + [final_token]
    return TreeVerdict(accepted_nodes=accepted, tokens=torch.tensor(emitted, dtype=torch.int64))


def _check_tree_inputs(
    layout: TreeLayout,
    node_tokens: torch.Tensor,  # [n] int64
    target: torch.Tensor,  # [n + 1, vocab] logits or probabilities
    name: str,
) -> list[int]:
    """Raise ValueError on bad shapes or node tokens outside [0, vocab); return the node tokens as a list."""
    n = layout.num_nodes
    if tuple(node_tokens.shape) != (n,):
        raise ValueError(f"node_tokens must be [n={n}], got {tuple(node_tokens.shape)}")
    if target.dim() != 2 or target.shape[0] != n + 1:
        raise ValueError(f"{name} must be [n + 1={n + 1}, vocab], got {tuple(target.shape)}")
    vocab = target.shape[1]
    tokens = node_tokens.tolist()
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        raise ValueError(f"node tokens must lie in [0, {vocab}), got min {min(tokens)} max {max(tokens)}")
    return tokens
