"""Drafters that run a small model of the target's tokenizer with their own KV cache of the committed sequence:
:class:`CachedModelDrafter` (the cache, its rollback and the prompt's context window) and :class:`ModelDrafter`
(the ``model`` drafter: one token per forward, autoregressively). The PARD drafter (drafters/pard.py) is the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.drafters.base import Draft, Drafter
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, choose_token, logits_to_probs, sample


class CachedModelDrafter(Drafter):
    """A small model with its own KV cache of the committed sequence, kept in sync by rollback.

    ``cached_tokens`` are the committed ids the cache accounts for. ``context_window`` = (sink, recent): a fresh
    cache given a longer prompt reads only its first ``sink`` and last ``recent`` ids (``skipped`` = how many it
    left out; None reads everything). Slot s of the cache holds id s when s < sink, else id s + skipped; every id
    keeps its own position (RoPE), so a window only hides context: the drafts change, never the output.
    """

    extra_slots = 0  # cache slots a draft pass writes past the committed sequence (and forgets)

    def __init__(self, model: Transformer, num_draft_tokens: int, target_vocab_size: int | None = None,
                 context_window: tuple[int, int] | None = None) -> None:
        super().__init__(num_draft_tokens)
        if context_window is not None and (context_window[0] < 0 or context_window[1] < 1):
            raise ValueError(f"context_window = (sink >= 0, recent >= 1) ids, got {context_window}")
        self.model = model
        self.target_vocab_size = target_vocab_size or model.config.vocab_size
        self.context_window = context_window
        self.cache: StaticKVCache | None = None
        self.cached_tokens: list[int] = []
        self.skipped = 0

    def unread(self, sequence: list[int]) -> int:
        return max(len(sequence) - len(self.cached_tokens), 1)  # approximately: a rollback may add a few

    def state_bytes(self, capacity: int) -> int:
        c = self.model.config
        return StaticKVCache.nbytes_for(c.num_layers, c.num_kv_heads, c.head_dim, capacity + self.extra_slots,
                                        self.model.dtype)

    def reset(self, capacity: int) -> None:
        capacity += self.extra_slots
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(capacity)
        self.cache.reset()
        self.cached_tokens = []
        self.skipped = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        """Read the prompt (or its first chunk) into the draft cache now: one forward, no logits. A prompt longer
        than the context window is read once, at its last chunk, so that the window keeps its last ids."""
        total = len(prompt_ids) if prompt_length is None else prompt_length
        if self.context_window is not None and total > sum(self.context_window) and len(prompt_ids) < total:
            return
        self._read_into_cache(prompt_ids)

    def _sync(self, sequence: list[int]) -> None:
        """Roll the draft cache back to the longest prefix it shares with the committed sequence, keeping at
        least one id of ``sequence`` (the pending one) to feed."""
        self._rollback_to_shared_prefix(sequence, len(sequence) - 1)

    def _rollback_to_shared_prefix(self, ids: list[int], limit: int) -> None:
        """Roll the cache back to the longest prefix (at most ``limit`` ids) it shares with ``ids``; to empty when
        that prefix ends inside the part of a prompt the window left out."""
        cached = self.cached_tokens
        common, limit = 0, min(len(cached), limit)
        while common < limit and cached[common] == ids[common]:
            common += 1
        if common == len(cached):
            return
        recent_start = (self.context_window[0] + self.skipped) if self.skipped else 0  # first id after the gap
        if common < recent_start:  # the shared prefix ends before the window's recent part: start over
            self.cache.reset()
            cached.clear()
            self.skipped = 0
            return
        self.cache.rollback(common - self.skipped)
        del cached[common:]

    def _read_into_cache(self, ids: list[int]) -> None:
        """Append the K/V of the ids the cache lacks (after rolling back to the prefix it shares with ``ids``),
        through the context window when the cache is fresh."""
        assert self.cache is not None, "reset() must be called before prefill() / propose()"
        self._rollback_to_shared_prefix(ids, len(ids))
        new = ids[len(self.cached_tokens) :]
        if not new:
            return
        first = len(self.cached_tokens)
        positions = list(range(first, first + len(new)))
        window = self.context_window
        if window is not None and self.cache.length == 0 and len(new) > sum(window):
            sink, recent = window
            self.skipped = len(new) - sink - recent
            positions = positions[:sink] + positions[-recent:]
        feed = [ids[p] for p in positions]
        device = self.model.device
        self.model(torch.tensor([feed], device=device), torch.tensor([positions], device=device), cache=self.cache,
                   logits="none")
        self.cached_tokens.extend(new)

    def _next_positions(self, count: int) -> torch.Tensor:
        """[1, count] int64: the positions of the next ``count`` ids fed after the cached ones."""
        first = len(self.cached_tokens)
        return torch.arange(first, first + count, device=self.model.device)[None]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad (with -inf) or trim the drafter's logits [..., V_draft] to the target's vocabulary size."""
        extra = self.target_vocab_size - logits.shape[-1]
        return F.pad(logits, (0, extra), value=float("-inf")) if extra > 0 else logits[..., : self.target_vocab_size]


class ModelDrafter(CachedModelDrafter):
    """Greedy drafts at T = 0 (deterministic); at T > 0 drafts are sampled and q_draft is handed to verification."""

    name = "model"

    def for_request(self) -> ModelDrafter:
        """The same draft model (weights shared), its own KV cache."""
        return ModelDrafter(self.model, self.num_draft_tokens, self.target_vocab_size, self.context_window)

    @torch.inference_mode()
    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        self._sync(sequence)
        pending = sequence[len(self.cached_tokens) :]  # ids the draft cache has not seen yet (>= 1)
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(num_draft_tokens):
            ids = torch.tensor([pending], device=self.model.device)
            logits = self.model(ids, self._next_positions(len(pending)), cache=self.cache, logits="last").logits
            self.cached_tokens.extend(pending)
            logits = self._to_target_vocab(logits[0, -1])  # [V]
            if params.greedy:
                token = int(choose_token(logits, params, None))
            else:
                q = logits_to_probs(logits, params)  # [V]
                token = int(sample(q, generator))
                dists.append(q)
            tokens.append(token)
            pending = [token]
        q_draft = torch.stack(dists) if dists else None
        return Draft(tokens=torch.tensor(tokens, dtype=torch.int64), q_draft=q_draft)
