"""Drafters that run a small model of the target's tokenizer with their own KV cache of the committed sequence:
:class:`CachedModelDrafter` (the cache, its rollback and the prompt's context window) and :class:`ModelDrafter`
(the ``model`` drafter: one token per forward, autoregressively). The PARD drafter (drafters/pard.py) is the other."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash2.drafters.base import Draft, Drafter, ExtendsAhead
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, choose_token, logits_to_probs, sample

if TYPE_CHECKING:
    from dflash2.drafters.spec import DraftOptions, DraftTarget


@dataclass(frozen=True)
class ContextWindow:
    """What a fresh draft cache reads of a long prompt: its first ``sink`` ids and its last ``recent``, each at its
    own position, where the prompt is longer than the window and than ``whole`` ids (shorter ones are read whole:
    a window smaller than the prompts chat sends most would cost them context)."""

    sink: int
    recent: int
    whole: int = 0

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 1 or self.whole < 0:
            raise ValueError(f"context_window = (sink >= 0, recent >= 1) ids, read whole up to whole >= 0 ids; got "
                             f"({self.sink}, {self.recent}), whole {self.whole}")

    def applies(self, length: int) -> bool:
        """Whether ``length`` ids are read through the window (else whole)."""
        return length > max(self.sink + self.recent, self.whole)


class CachedModelDrafter(ExtendsAhead, Drafter):
    """A small model with its own KV cache of the committed sequence, kept in sync by rollback.

    ``cached_tokens`` are the committed ids the cache accounts for; ``slot_ids[s]`` is the index in them of the id
    cache slot s holds (every id keeps its own position, RoPE: a left-out id only hides context, so the drafts
    change, never the output). Two windows leave ids out:
    - ``context_window`` (:class:`ContextWindow`, or (sink, recent)): a fresh cache given a longer prompt reads only
      its first ``sink`` and last ``recent`` ids (None reads everything);
    - ``catch_up``: a cache that fell behind (a drafter idle while speculation was off, or while prompt lookup
      drafted) reads only the last ``catch_up`` of the ids it missed (None reads them all): resuming then costs
      about a usual pass, not a forward over every id committed meanwhile.
    ``reader``: when set (pard in Q8_0 / Q4_0 blocks on AMX: ``pard.reading_twin``), reads of at least
    ``READER_MIN_IDS`` ids (a prompt) go through it instead of ``model``: the same network laid out for many rows.

    Capabilities (drafters/base.py): :class:`~dflash2.drafters.base.KeepsState` (with each subclass's
    ``for_request``), :class:`~dflash2.drafters.base.CatchesUp`, :class:`~dflash2.drafters.base.DraftsAhead`.
    """

    extra_slots = 0  # cache slots a draft pass writes past the committed sequence (and forgets)
    READER_MIN_IDS = 32  # a read of at least this many ids goes through ``reader`` when there is one

    def __init__(self, model: Transformer, num_draft_tokens: int, target_vocab_size: int | None = None,
                 context_window: ContextWindow | tuple[int, int] | None = None, catch_up: int | None = None,
                 reader: Transformer | None = None) -> None:
        super().__init__(num_draft_tokens)
        if isinstance(context_window, tuple):
            context_window = ContextWindow(*context_window)
        if catch_up is not None and catch_up < 1:
            raise ValueError(f"catch_up must be >= 1 ids (or None: all), got {catch_up}")
        self.model = model
        self.reader = reader  # the same network laid out for many rows (pard.reading_twin); None: ``model``
        self.target_vocab_size = target_vocab_size or model.config.vocab_size
        self.context_window = context_window
        self.catch_up = catch_up
        self.cache: StaticKVCache | None = None
        self.cached_tokens: list[int] = []
        self.slot_ids: list[int] = []
        self.prompt_gap_end = 0  # the first id after the ids the context window left out (0: none left out)

    @property
    def skipped(self) -> int:
        """Committed ids the cache left out (windows)."""
        return len(self.cached_tokens) - len(self.slot_ids)

    def unread(self, sequence: list[int]) -> int:
        behind = len(sequence) - len(self.cached_tokens)  # approximately: a rollback may add a few
        if self.catch_up is not None and self.slot_ids:
            behind = min(behind, self.catch_up)
        return max(behind, 1)

    def state_bytes(self, capacity: int) -> int:
        c = self.model.config
        return StaticKVCache.nbytes_for(c.num_layers, c.num_kv_heads, c.head_dim, capacity + self.extra_slots,
                                        self.model.dtype)

    def held_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def reset(self, capacity: int) -> None:
        capacity += self.extra_slots
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(capacity)
        self._clear()

    def _clear(self) -> None:
        self.cache.reset()
        self.cached_tokens = []
        self.slot_ids = []
        self.prompt_gap_end = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        """Read the prompt (or its first chunk) into the draft cache now: one forward, no logits. A prompt longer
        than the context window is read once, at its last chunk, so that the window keeps its last ids."""
        total = len(prompt_ids) if prompt_length is None else prompt_length
        if self.context_window is not None and self.context_window.applies(total) and len(prompt_ids) < total:
            return
        self._read_into_cache(prompt_ids)

    def _sync(self, sequence: list[int]) -> None:
        """Roll the draft cache back to the longest prefix it shares with the committed sequence, keeping at
        least one id of ``sequence`` (the pending one) to feed."""
        self._rollback_to_shared_prefix(sequence, len(sequence) - 1)

    def _rollback_to_shared_prefix(self, ids: list[int], limit: int) -> None:
        """Roll the cache back to the longest prefix (at most ``limit`` ids) it shares with ``ids``; to empty when
        that prefix ends inside the part of a prompt the context window left out."""
        cached = self.cached_tokens
        common, limit = 0, min(len(cached), limit)
        while common < limit and cached[common] == ids[common]:
            common += 1
        if common == len(cached):
            return
        if common < self.prompt_gap_end:  # the shared prefix ends before the window's recent part: start over
            self._clear()
            return
        slots = bisect.bisect_left(self.slot_ids, common)  # the slots of ids before `common`
        self.cache.rollback(slots)
        del self.slot_ids[slots:]
        del cached[common:]

    def _unread_positions(self, ids: list[int]) -> list[int]:
        """Indices of the ids of ``ids`` the cache lacks that the next forward feeds: all of them, or what the
        windows keep (a fresh cache: the context window; a cache that fell behind: the last ``catch_up``)."""
        positions = list(range(len(self.cached_tokens), len(ids)))
        window = self.context_window
        if not self.slot_ids:
            if window is not None and window.applies(len(positions)):
                sink, recent = window.sink, window.recent
                self.prompt_gap_end = positions[-recent]
                return positions[:sink] + positions[-recent:]
        elif self.catch_up is not None and len(positions) > self.catch_up:
            return positions[-self.catch_up :]
        return positions

    def _mark_read(self, ids: list[int], positions: list[int]) -> None:
        """The cache now holds ``positions`` of ``ids`` (and accounts for every id of ``ids``)."""
        self.slot_ids.extend(positions)
        self.cached_tokens.extend(ids[len(self.cached_tokens) :])

    def _read_into_cache(self, ids: list[int]) -> None:
        """Append the K/V of the ids the cache lacks (after rolling back to the prefix it shares with ``ids``),
        through the windows."""
        assert self.cache is not None, "reset() must be called before prefill() / propose()"
        self._rollback_to_shared_prefix(ids, len(ids))
        positions = self._unread_positions(ids)
        if not positions:
            return
        device = self.model.device
        feed = [ids[p] for p in positions]
        many = self.reader is not None and len(feed) >= self.READER_MIN_IDS
        (self.reader if many else self.model)(torch.tensor([feed], device=device),
                                              torch.tensor([positions], device=device), cache=self.cache,
                                              logits="none", input_offsets=self._read_offsets(positions))
        self._mark_read(ids, positions)

    def _read_offsets(self, positions: list[int]) -> torch.Tensor | None:
        """[1, n, D] input offsets of the ids read at ``positions`` (a drafter conditioned on the target), or None."""
        return None

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad (with -inf) or trim the drafter's logits [..., V_draft] to the target's vocabulary size."""
        extra = self.target_vocab_size - logits.shape[-1]
        return F.pad(logits, (0, extra), value=float("-inf")) if extra > 0 else logits[..., : self.target_vocab_size]


class ModelDrafter(CachedModelDrafter):
    """Greedy drafts at T = 0 (deterministic); at T > 0 drafts are sampled and q_draft is handed to verification."""

    name = "model"

    def for_request(self) -> ModelDrafter:
        """The same draft model (weights shared), its own KV cache."""
        return ModelDrafter(self.model, self.num_draft_tokens, self.target_vocab_size, self.context_window,
                            self.catch_up)

    @torch.inference_mode()
    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        self._sync(sequence)
        sequence = list(sequence)  # the drafts are appended to a copy
        positions = self._unread_positions(sequence)  # ids the draft cache has not read yet (>= 1)
        device = self.model.device
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(num_draft_tokens):
            ids = torch.tensor([[sequence[p] for p in positions]], device=device)
            logits = self.model(ids, torch.tensor([positions], device=device), cache=self.cache,
                                logits="last").logits
            self._mark_read(sequence, positions)
            logits = self._to_target_vocab(logits[0, -1])  # [V]
            if params.greedy:
                token = int(choose_token(logits, params, None))
            else:
                q = logits_to_probs(logits, params)  # [V]
                token = int(sample(q, generator))
                dists.append(q)
            tokens.append(token)
            sequence.append(token)
            positions = [len(sequence) - 1]
        q_draft = torch.stack(dists) if dists else None
        return Draft(tokens=torch.tensor(tokens, dtype=torch.int64), q_draft=q_draft)


def build_model_drafter(target: DraftTarget, options: DraftOptions) -> ModelDrafter:
    """``model[:k]``: ``options.draft_model`` (default: the store's draft model paired with the target), which must
    share the target's tokenizer; a chain (one token per pass)."""
    from dflash2.models.loading import load_transformer
    from dflash2.models.store import default_draft, resolve_model

    if options.spec.width > 1:
        raise ValueError(f"drafter {str(options.spec)!r}: the model drafter drafts a chain (one token per pass); it "
                         f"takes no tree width W")
    ref = options.draft_model or default_draft(target.name)
    if ref is None:
        raise ValueError(f"no default draft model for {target.name!r}; pass draft_model / --draft-model")
    draft_dir = resolve_model(ref, options.dtype, pull=options.pull)
    if not target.tokenizer.same_vocabulary(draft_dir):
        raise ValueError(f"draft model {ref!r} has a different tokenizer from the target; it cannot draft for it")
    model = load_transformer(draft_dir, options.dtype, target.target.device, weights=options.weights)
    return ModelDrafter(model, options.num_draft_tokens, target_vocab_size=target.target.config.vocab_size)
