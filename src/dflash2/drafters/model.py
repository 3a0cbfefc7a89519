"""An independent small model of the same tokenizer drafts autoregressively, with its own KV cache kept in sync."""

from __future__ import annotations

import torch

from dflash2.drafters.base import Draft, Drafter
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, choose_token, logits_to_probs, sample


class ModelDrafter(Drafter):
    """Greedy drafts at T = 0 (deterministic); at T > 0 drafts are sampled and q_draft is handed to verification."""

    name = "model"

    def __init__(self, model: Transformer, num_draft_tokens: int = 4, target_vocab_size: int | None = None) -> None:
        super().__init__(num_draft_tokens)
        self.model = model
        self.target_vocab_size = target_vocab_size or model.config.vocab_size
        self.cache: StaticKVCache | None = None
        self.cached_tokens: list[int] = []  # the committed ids ``cache`` accounts for (see read_into_cache)
        self.context_window: tuple[int, int] | None = None  # (sink, recent) ids of a long prompt it reads; None: all
        self.skipped = 0

    def for_request(self) -> ModelDrafter:
        """The same draft model (weights shared), its own KV cache."""
        return ModelDrafter(self.model, self.num_draft_tokens, self.target_vocab_size)

    def state_bytes(self, capacity: int) -> int:
        c = self.model.config
        return StaticKVCache.nbytes_for(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.model.dtype)

    def reset(self, capacity: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(capacity)
        self.cache.reset()
        self.cached_tokens = []
        self.skipped = 0

    @torch.inference_mode()
    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        self._sync(sequence)
        pending = sequence[len(self.cached_tokens) :]  # ids the draft cache has not seen yet (>= 1)
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(num_draft_tokens):
            ids = torch.tensor([pending], device=self.model.device)
            positions = next_positions(self, len(pending))
            logits = self.model(ids, positions, cache=self.cache, logits="last").logits[0, -1]  # [V_draft]
            self.cached_tokens.extend(pending)
            logits = self._to_target_vocab(logits)
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

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        """Read the prompt into the draft cache now (one forward, no logits)."""
        read_into_cache(self, prompt_ids)

    def _sync(self, sequence: list[int]) -> None:
        """Roll the draft cache back to the longest prefix it shares with the committed sequence, keeping at
        least one id of ``sequence`` to feed."""
        rollback_to_shared_prefix(self, sequence, len(sequence) - 1)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad (with -inf) or trim the drafter's logits [V_draft] to the target's vocabulary size."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[: self.target_vocab_size]


# ---- the draft cache of a small-model drafter (ModelDrafter, PardDrafter) --------------------------------
# Both keep ``model``, ``cache`` (a StaticKVCache), ``cached_tokens`` (the committed ids the cache accounts for) and
# ``skipped`` (ids of a long prompt it left out, see ``context_window``). Slot s of the cache holds id s when
# s < sink, else id s + skipped; every id keeps its own position (RoPE), so a window only hides context.


def rollback_to_shared_prefix(drafter, ids: list[int], limit: int) -> None:
    """Roll ``drafter.cache`` back to the longest prefix (at most ``limit`` ids) it shares with ``ids``; to empty
    when that prefix ends inside the part of a prompt the window left out."""
    cached = drafter.cached_tokens
    common, limit = 0, min(len(cached), limit)
    while common < limit and cached[common] == ids[common]:
        common += 1
    if common == len(cached):
        return
    recent_start = (drafter.context_window[0] + drafter.skipped) if drafter.skipped else 0  # first id after the gap
    if common < recent_start:  # the shared prefix ends before the window's recent part: start over
        drafter.cache.reset()
        cached.clear()
        drafter.skipped = 0
        return
    drafter.cache.rollback(common - drafter.skipped)
    del cached[common:]


def read_into_cache(drafter, ids: list[int]) -> None:
    """Append the K/V of the ids the draft cache lacks (after rolling back to the prefix it shares with ``ids``).
    A fresh cache given more ids than ``context_window`` = (sink, recent) allows reads only the first ``sink`` and
    the last ``recent`` of them (the rest is ``skipped``: a long prompt costs the drafter at most sink + recent ids)."""
    assert drafter.cache is not None, "reset() must be called before prefill()"
    rollback_to_shared_prefix(drafter, ids, len(ids))
    new = ids[len(drafter.cached_tokens) :]
    if not new:
        return
    first = len(drafter.cached_tokens)
    positions = list(range(first, first + len(new)))
    window = drafter.context_window
    if window is not None and drafter.cache.length == 0 and len(new) > sum(window):
        sink, recent = window
        drafter.skipped = len(new) - sink - recent
        positions = positions[:sink] + positions[-recent:]
    feed = [ids[p] for p in positions]
    device = drafter.model.device
    drafter.model(torch.tensor([feed], device=device), torch.tensor([positions], device=device), cache=drafter.cache,
                  logits="none")
    drafter.cached_tokens.extend(new)


def next_positions(drafter, count: int) -> torch.Tensor:
    """[1, count] int64: the positions of the next ``count`` ids fed after the cached ones."""
    first = len(drafter.cached_tokens)
    return torch.arange(first, first + count, device=drafter.model.device)[None]
