"""transformers peers: plain ``generate``, assisted generation with the small draft model, prompt-lookup decoding.

Same weights (the store's converted directories), dtype, prompt ids (dflash2's chat template), greedy decoding,
stop tokens and torch threads as the dflash2 methods they run beside.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from dflash2.peers.base import PeerResult, PeerSetup, cut_at_eos, require_draft

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value (and the value of reference.md's measurement)


class TransformersPeer:
    """One transformers decoding mode; ``generate_kwargs`` selects assisted or prompt-lookup decoding."""

    def __init__(self, name: str, model, eos_ids: frozenset[int], generate_kwargs: dict | None = None,
                 plain_sibling: str | None = None) -> None:
        self.name = name
        self.plain_sibling = plain_sibling
        self.model = model
        self.eos_ids = eos_ids
        self.generate_kwargs = generate_kwargs or {}
        self._forwards = 0
        model.register_forward_hook(self._count_forward)

    def _count_forward(self, module, inputs, output) -> None:
        self._forwards += 1

    def _generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        eos = sorted(self.eos_ids)
        with torch.inference_mode():
            return self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None,
                                       temperature=None, eos_token_id=eos, pad_token_id=eos[0],
                                       **self.generate_kwargs)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        """Prefill time from a one-token generation, then the full generation; decode = full - prefill."""
        ids = torch.tensor([list(prompt_ids)])  # [1, prompt]
        start = time.perf_counter()
        self._generate(ids, 1)
        prefill = time.perf_counter() - start
        self._forwards = 0
        start = time.perf_counter()
        out = self._generate(ids, max_new_tokens)  # [1, prompt + new]
        elapsed = time.perf_counter() - start
        new_ids, finish = cut_at_eos(out[0, ids.shape[1]:].tolist(), self.eos_ids)
        return PeerResult(new_ids, len(prompt_ids), prefill, max(elapsed - prefill, 1e-9),
                          target_forwards=self._forwards, finish_reason=finish)

    def close(self) -> None:
        self.model = None


def _load(model_dir, dtype: str):
    from transformers import AutoModelForCausalLM

    from dflash2.models.loading import parse_dtype

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=parse_dtype(dtype)).eval()


def build_transformers_peers(names: Sequence[str], setup: PeerSetup) -> list[TransformersPeer]:
    """The requested transformers peers, sharing one loaded target (hooks count each peer's own forwards)."""
    if not names:
        return []
    target = _load(setup.target_dir, setup.dtype)
    peers = []
    for name in names:
        kwargs: dict = {}
        if name == "transformers-assisted":
            draft = _load(require_draft(setup, name)[0], setup.dtype)
            if setup.num_draft_tokens is not None:
                draft.generation_config.num_assistant_tokens = setup.num_draft_tokens
            kwargs = {"assistant_model": draft}
        elif name == "transformers-pld":
            kwargs = {"prompt_lookup_num_tokens": setup.num_draft_tokens or PROMPT_LOOKUP_TOKENS}
        peers.append(TransformersPeer(name, target, setup.eos_ids, kwargs,
                                      plain_sibling=None if name == "transformers" else "transformers"))
    return peers
