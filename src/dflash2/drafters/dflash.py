"""DFlash: a block drafter that reads the target's hidden states and drafts a whole block in one pass.

The drafter is a small stack of ordinary decoder layers at the target's width, with no embedding or head of
its own: block inputs are the target's (frozen) embeddings and draft logits come from the target's (frozen)
LM head. It is conditioned on the target through a *context*: the hidden states of a few tapped target
layers, concatenated along features, projected by ``fc`` and RMS-normed. In every drafter layer the context
goes through that layer's own k/v projections (rotary at the context positions) and is prepended to the
block's keys/values; queries come only from the block.

A block is ``[pending token, MASK x (block_size - 1)]`` at positions ``start .. start + block_size - 1``,
where ``start`` is the pending token's position. Attention inside the block is bidirectional and every block
position sees the whole context, i.e. exactly the committed positions ``0 .. start - 1``. Block position
``j >= 1`` yields the draft for position ``start + j``: one forward pass gives ``block_size - 1`` drafts.

Context bookkeeping (:class:`DFlashDrafter`): the projected context K/V of every committed position live in
a :class:`~dflash2.kv.StaticKVCache`; the block's own K/V are never stored. The pending token's taps are only
known after the verification pass that writes it into the target's cache, so after every ``observe`` the
cache holds ``len(sequence) - 1`` positions: every committed token except the pending one.

Checkpoints follow the DFlash convention (a Hugging Face style directory: ``config.json`` with the layer
config plus ``block_size``, ``target_layer_ids``, ``mask_token_id``; ``model.safetensors`` without
embedding or head), so drafters trained here can be served by engines that load DFlash drafters.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from dflash2.drafters.base import Draft, Drafter
from dflash2.drafters.dflash2_parts import best_tree, select_path
from dflash2.drafters.dflash_config import (
    DFlashConfig,
    default_mask_token_id,
    default_target_layer_ids,
)
from dflash2.drafters.dflash_model import DFlashDraftModel
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, logits_to_probs, sample

if TYPE_CHECKING:
    from dflash2.drafters.spec import DraftOptions, DraftTarget

TRAINED_DIR = Path(__file__).parent / "trained"  # trained drafters shipped with the package, one per target


class DFlashDrafter(Drafter):
    """Drafts ``block_size - 1`` tokens per target pass from one drafter forward over the block.

    Greedy drafts at T = 0 (``q_draft`` None); at T > 0 each position is sampled independently from its
    warped distribution, and ``q_draft`` [k, V] goes to rejection sampling.

    ``num_paths`` W > 1 drafts a tree instead: k * W nodes, the chain plus the likeliest branches through the
    block's top candidates (:func:`~dflash2.drafters.dflash2_parts.best_tree`), verified in one target pass with
    tree attention. The tree is deterministic, so at T > 0 it is verified by the exact deterministic rule (draw
    from the target, follow the child that matches).

    Capabilities (drafters/base.py): ``KeepsState`` (its context cache), ``DraftsAhead`` (the block's known tokens
    fill its first mask positions).
    """

    name = "dflash"
    cost_per_pass = True

    def __init__(self, model: DFlashDraftModel, target: Transformer, num_draft_tokens: int | None = None,
                 num_paths: int = 1) -> None:
        if num_paths < 1:
            raise ValueError(f"num_paths must be >= 1, got {num_paths}")
        limit = model.config.block_size - 1
        num_draft_tokens = limit if num_draft_tokens is None else num_draft_tokens
        if num_draft_tokens > limit:
            raise ValueError(f"a block of {model.config.block_size} yields at most {limit} drafts, "
                             f"asked for {num_draft_tokens}")
        config = model.config
        if (config.vocab_size, config.hidden_size) != (target.config.vocab_size, target.config.hidden_size):
            raise ValueError("the DFlash drafter was made for a target of another width or vocabulary")
        if max(config.target_layer_ids) >= target.config.num_layers:
            raise ValueError(
                f"target_layer_ids {config.target_layer_ids} exceed the target's {target.config.num_layers} layers"
            )
        super().__init__(num_draft_tokens)
        self.model = model.eval()
        self.target = target
        self.hidden_layers = tuple(model.config.target_layer_ids)
        self.cache: StaticKVCache | None = None  # context K/V of the committed positions, pending token excluded
        self.num_paths = num_paths
        self.name = "dflash" if model.selector is None else "dflash2"

    @property
    def max_draft_tokens(self) -> int:
        """Nodes of the largest draft: one chain, or a tree of ``num_paths`` times its draft length."""
        return self.num_draft_tokens * self.num_paths

    def for_request(self) -> DFlashDrafter:
        """The same drafter model and target (weights shared), its own context cache."""
        return DFlashDrafter(self.model, self.target, self.num_draft_tokens, self.num_paths)

    @property
    def context_length(self) -> int:
        """Committed positions whose context K/V are cached (= the next block's start position)."""
        return 0 if self.cache is None else self.cache.length

    def state_bytes(self, capacity: int) -> int:
        c = self.model.config
        return StaticKVCache.nbytes_for(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.model.dtype)

    def held_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def reset(self, capacity: int) -> None:
        c = self.model.config
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity,
                                       dtype=self.model.dtype, device=self.model.device)
        self.cache.reset()

    @torch.inference_mode()
    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """Append the context K/V of the newly committed positions (their taps just came from the target).

        The taps cover positions ``[before, before + n)`` with ``before = len(sequence) - 1 - n``: the newest
        token of ``sequence`` is pending and has no taps yet. Cached context past ``before`` is cropped.
        """
        assert self.cache is not None, "reset() must be called before observe()"
        if num_accepted < 0:
            self.cache.reset()
        count = target_hidden[0].shape[1]
        before = len(sequence) - 1 - count
        if before < 0:
            raise ValueError(f"{count} tapped positions do not fit a sequence of {len(sequence)} ids")
        if self.cache.length > before:
            self.cache.rollback(before)
        elif self.cache.length < before:
            raise RuntimeError(f"context gap: {self.cache.length} positions cached, taps start at {before}")
        positions = torch.arange(before, before + count, device=self.model.device)[None]  # [1, n]
        context = self.model.project_context(target_hidden)  # [1, n, D]
        for layer, (k, v) in enumerate(self.model.context_kv(context, positions)):
            self.cache.write(layer, k, v)
        self.cache.advance(count)

    @torch.inference_mode()
    def propose(
        self, sequence: list[int], num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        k = min(num_draft_tokens, self.num_draft_tokens)
        if k <= 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)
        start = len(sequence) - 1  # the pending token's position
        if self.cache.length != start:
            raise RuntimeError(f"the drafter's context holds {self.cache.length} positions, expected {start}")
        if self.num_paths > 1:
            return self._tree_draft(sequence[-1], start, k)
        if self.model.selector is not None:
            return self._selected_draft(sequence[-1], start, k, params, generator)
        logits = self.block_logits(sequence[-1], start)[1 : k + 1]  # [k, V]
        return _draft_from_logits(logits, params, generator)

    @torch.inference_mode()
    def propose_ahead(self, sequence, block, num_draft_tokens, params: SamplingParams, generator) -> Draft | None:
        """Pre-draft before the taps of ``block`` exist: the block's tokens fill the first mask positions
        ([pending, block..., MASK...]) and the masks after them draft the bonus guess and the next block.
        None when the masks left cannot hold the guess and one draft (len(block) >= block_size - 2)."""
        assert self.cache is not None, "reset() must be called before propose_ahead()"
        first = len(block) + 1  # block position of the bonus guess
        last = min(first + num_draft_tokens, self.model.config.block_size - 1)
        if last <= first:  # room for the bonus guess and at least one draft after it
            return None
        start = len(sequence) - 1
        if self.cache.length != start:
            raise RuntimeError(f"the drafter's context holds {self.cache.length} positions, expected {start}")
        logits = self.block_logits(sequence[-1], start, known=block)[first : last + 1]  # [1 + n, V]
        return _draft_from_logits(logits, params, generator)

    def _selected_draft(
        self, pending: int, start: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """DFlash2: the path the selector walks through the top-K candidates (q_draft sparse over them)."""
        model = self.model
        hidden, logits, pending_row = self._draft_positions(pending, start, k)
        temperature = 0.0 if params.greedy else params.temperature
        path = select_path(model.selector, logits, hidden, pending_row, temperature, generator)
        tokens = self._vocab_ids(path.rows)
        if path.q is None:
            return Draft(tokens=tokens.cpu(), q_draft=None)
        q_draft = torch.zeros(k, model.config.vocab_size, device=path.q.device)  # [k, V]
        q_draft.scatter_(1, self._vocab_ids(path.candidates), path.q)
        return Draft(tokens=tokens.cpu(), q_draft=q_draft)

    def _tree_draft(self, pending: int, start: int, k: int) -> Draft:
        """A deterministic tree of k * num_paths nodes: the chain and the likeliest branches (``best_tree``)."""
        hidden, logits, pending_row = self._draft_positions(pending, start, k)
        rows, parents = best_tree(self.model.selector, logits, hidden, pending_row, k * self.num_paths)
        tokens = self._vocab_ids(torch.tensor(rows, dtype=torch.int64, device=logits.device))
        return Draft(tokens=tokens.cpu(), q_draft=None, parents=parents)

    def _draft_positions(self, pending: int, start: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Hidden states [k, D] and draft-vocabulary logits [k, V'] of block positions 1 .. k, and the selector's
        codebook row of the pending token (0 without a selector)."""
        model = self.model
        hidden = self.block_hidden(pending, start)[1 : k + 1]  # [k, D]
        logits = model.draft_logits(self.target, hidden)  # [k, V']
        if model.selector is None:
            return hidden, logits, 0
        return hidden, logits, int(model.selector_rows(torch.tensor([pending], device=model.device))[0])

    def _vocab_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary rows -> target ids."""
        vocab = self.model.draft_vocab
        return rows if vocab is None else vocab[rows]

    def block_hidden(self, pending: int, start: int, known: Sequence[int] = ()) -> torch.Tensor:
        """The drafter's hidden states [block_size, D] of the block [pending, known..., MASK...] at positions
        start .. start + bs - 1 (``known``: tokens already drafted after the pending one, used by pre-drafting)."""
        config, device = self.model.config, self.model.device
        ids = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.int64, device=device)
        ids[0, 0] = pending
        ids[0, 1 : 1 + len(known)] = torch.tensor(list(known), dtype=torch.int64, device=device)
        positions = torch.arange(start, start + config.block_size, device=device)[None]  # [1, bs]
        context = [(self.cache.keys[layer, :, :, :start], self.cache.values[layer, :, :, :start])
                   for layer in range(config.num_layers)]
        return self.model(self.model.embed(self.target, ids), positions, context)[0]

    def block_logits(self, pending: int, start: int, known: Sequence[int] = ()) -> torch.Tensor:
        """float32 logits [block_size, V] of the block [pending, known..., MASK...] (see :meth:`block_hidden`)."""
        return self.model.logits(self.target, self.block_hidden(pending, start, known))


def _draft_from_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Draft:
    """A chain from block logits [k, V]: argmax at T = 0 (q_draft None), else sampled with q_draft [k, V]."""
    if params.greedy:
        return Draft(tokens=logits.argmax(dim=-1).cpu(), q_draft=None)
    q_draft = logits_to_probs(logits, params)  # [k, V]
    return Draft(tokens=sample(q_draft, generator).cpu(), q_draft=q_draft)


DEFAULT_DRAFT_LENGTH_KEY = "default_num_draft_tokens"  # optional config.json key (dflash2's own)


def load_dflash_drafter(
    directory: str | Path,
    target: Transformer,
    num_draft_tokens: int | None = None,
    dtype: str | torch.dtype | None = None,
    num_paths: int = 1,
) -> DFlashDrafter:
    """Load a saved drafter for ``target`` (dtype and device default to the target's).

    ``num_draft_tokens`` None: the draft length recorded in config.json as ``default_num_draft_tokens`` (the one
    measured best for that drafter), else ``block_size - 1``. bf16 / fp16 drafters on a CPU run their projections
    through the packed kernel, like the target.
    """
    from dflash2.models.loading import own_memory, should_pack

    model = DFlashDraftModel.from_pretrained(directory, dtype or target.dtype, target.device)
    if should_pack(model.device, model.dtype):
        own_memory(model.pack())  # what is not packed stops pinning the file's memory map
    if num_draft_tokens is None:
        num_draft_tokens = model.config.extra.get(DEFAULT_DRAFT_LENGTH_KEY)
    return DFlashDrafter(model, target, num_draft_tokens, num_paths)


def build_block_drafter(target: DraftTarget, options: DraftOptions) -> Drafter:
    """``dflash[:kxW]`` / ``dflash2[:kxW]``: a trained block drafter, ``options.draft_model`` or the one shipped for
    the target (W > 1: a tree of k * W nodes through the block's top candidates). A ``dflash2`` directory with a
    target conditioning holds the pretrained 0.5B's PARD adapter reading the target's hidden states instead
    (drafters/conditioned.py)."""
    from dflash2.drafters.conditioning import has_conditioning

    kind, draft_model, k = options.spec.name, options.draft_model, options.num_draft_tokens
    if kind == "dflash2" and draft_model is not None and has_conditioning(draft_model):
        from dflash2.drafters.conditioned import build_conditioned_drafter

        return build_conditioned_drafter(target, draft_model, k, dtype=options.dtype, weights=options.weights,
                                         pull=options.pull, num_paths=options.spec.width)
    directory = draft_model or shipped_dflash_drafter(target.name, kind)
    return load_dflash_drafter(directory, target.target, k, num_paths=options.spec.width)


def shipped_dflash_drafter(target_name: str, kind: str = "dflash") -> Path:
    """The trained drafter shipped in the package for a store target: ``drafters/trained/<target>`` (DFlash) or
    ``drafters/trained/<target>-dflash2`` (DFlash2)."""
    from dflash2.models.store import canonical_name

    if kind not in ("dflash", "dflash2"):
        raise ValueError(f"kind must be dflash or dflash2, got {kind!r}")
    name = canonical_name(target_name) or target_name
    name = name if kind == "dflash" else f"{name}-dflash2"
    directory = TRAINED_DIR / name
    if not (directory / "config.json").exists():
        shipped = ", ".join(sorted(p.name for p in TRAINED_DIR.glob("*") if (p / "config.json").exists())) or "none"
        raise ValueError(f"no trained {kind} drafter is shipped as {name!r} (shipped: {shipped}); train one with "
                         f"`dflash2 train {kind}` and pass its directory as --draft-model")
    return directory


__all__ = [
    "DFlashConfig", "DFlashDraftModel", "DFlashDrafter", "TRAINED_DIR", "build_block_drafter",
    "default_mask_token_id", "default_target_layer_ids", "load_dflash_drafter", "shipped_dflash_drafter",
]
