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
        self.cached_tokens: list[int] = []  # the ids whose K/V are in ``cache`` (mirrors cache.length)

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

    @torch.inference_mode()
    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        self._sync(sequence)
        pending = sequence[len(self.cached_tokens) :]  # ids the draft cache has not seen yet (>= 1)
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(num_draft_tokens):
            ids = torch.tensor([pending], device=self.model.device)
            logits = self.model(ids, cache=self.cache, logits="last").logits[0, -1]  # [V_draft]
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
# Both keep ``model``, ``cache`` (a StaticKVCache) and ``cached_tokens`` (the ids whose K/V it holds).


def rollback_to_shared_prefix(drafter, ids: list[int], limit: int) -> None:
    """Roll ``drafter.cache`` back to the longest prefix (at most ``limit`` ids) it shares with ``ids``."""
    cached = drafter.cached_tokens
    common, limit = 0, min(len(cached), limit)
    while common < limit and cached[common] == ids[common]:
        common += 1
    if common < len(cached):
        drafter.cache.rollback(common)
        del cached[common:]


def read_into_cache(drafter, ids: list[int]) -> None:
    """Append the K/V of the ids the draft cache lacks (after rolling back to the prefix it shares with ``ids``)."""
    assert drafter.cache is not None, "reset() must be called before prefill()"
    rollback_to_shared_prefix(drafter, ids, len(ids))
    new = ids[len(drafter.cached_tokens) :]
    if new:
        drafter.model(torch.tensor([new], device=drafter.model.device), cache=drafter.cache, logits="none")
        drafter.cached_tokens.extend(new)
