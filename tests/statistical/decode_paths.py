"""Shared set-up of the end-to-end statistical tests: tiny models with a 6-token vocabulary, the target's exact
distribution of the first generated tokens by enumeration, seeded runs through the user's paths, the checks, and
the broken rules their companions use.

Exactness: the target's distribution of the first ``DEPTH`` generated tokens is computed by enumerating every
prefix of up to 3 tokens (259 prefixes, one batched forward per length) with the same warps as decoding
(``logits_to_probs``). Sampled runs are compared with it by Pearson chi-square tests: the marginals of the tokens
1, 2, 3 (token 0 comes from the prefill, not from verification) and the joint distributions of the tokens (0, 1, 2)
and (1, 2, 3), each at p-value ``MIN_P_VALUE``: with five tests per check a lossless path fails with probability
< 5 * MIN_P_VALUE = 5e-7. Seeds are fixed, so every outcome is deterministic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator
from unittest import mock

import torch

from dflash2.decode.engine import Engine
from dflash2.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from dflash2.drafters.dflash2_parts import DynamicConv
from dflash2.models.decoder import Transformer
from dflash2.models.loading import load_transformer
from dflash2.verify import ChainVerdict, TreeVerdict, verify_chain
from dflash2.verify.greedy import chain_tokens
from dflash2.verify.sampling import SamplingParams, logits_to_probs, sample
from tests.statistical.chisq import chi_square_p_value

VOCAB = 6
DEPTH = 4  # generated tokens whose joint distribution is enumerated
MIN_P_VALUE = 1e-7
DRAFT_VOCAB = torch.tensor([4, 1, 0, 3])  # a draft vocabulary: ids 2 and 5 are never drafted


class IdTokenizer:
    """Token ids as text, no stop token (a stop would end runs early and change what is counted)."""

    eos_token_ids: frozenset[int] = frozenset()
    has_chat_template = False

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def encode_prompt(self, text):  # a raw prompt: no special tokens to add
        return self.encode(text)


def tiny_target(directory, seed: int = 5, scale: float = 0.7) -> Transformer:
    """A 1-layer Qwen2 (hidden 32, biases) over VOCAB ids, fp32, fairly flat so that many paths get mass."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif param.dim() == 2:
                param.mul_(2.0 * scale)
    model.save_pretrained(str(directory))
    return load_transformer(directory, "fp32")


def tiny_drafter_model(target: Transformer, *, seed: int, selector: bool = False, draft_vocab: bool = False,
                       block_size: int = 4, scale: float = 3.0) -> DFlashDraftModel:
    """A random DFlash (or, with ``selector``, DFlash2: path selector over the top 3, dynamic convolution) drafter
    for ``target``; weights sharpened by ``scale`` so that q is far from p; optionally a 4-id draft vocabulary."""
    torch.manual_seed(seed)
    extra = dict(selector_rank=4, selector_top_k=3, conv_group=8) if selector else {}
    config = DFlashConfig.for_target(target.config, num_layers=1, block_size=block_size,
                                     draft_vocab_size=len(DRAFT_VOCAB) if draft_vocab else 0, **extra)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(scale)
        for module in model.modules():  # away from the identity / zero-gate init, so the DFlash2 parts matter
            if isinstance(module, DynamicConv):
                module.taps.weight.normal_(std=0.3)
        if model.selector is not None:
            for weight in (model.selector.gate.weight, model.selector.next_codes.weight,
                           model.selector.prev_codes.weight):
                weight.normal_(std=1.0)
    if draft_vocab:
        model.set_draft_vocab(DRAFT_VOCAB)
    return model.eval()


def tiny_engine(target: Transformer, drafter: DFlashDrafter | None, pipeline: str = "sync") -> Engine:
    return Engine(target, IdTokenizer(), drafter=drafter, name="tiny", pipeline=pipeline, draft_threads=1)


@torch.inference_mode()
def exact_joint(target: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[VOCAB] * DEPTH float64: P(first DEPTH generated tokens), enumerated with the decoding warps."""
    joint = torch.ones(1, dtype=torch.float64)  # over prefixes of the current length, in lexicographic order
    prefixes = torch.zeros(1, 0, dtype=torch.int64)
    for _ in range(DEPTH):
        ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)  # [B, T]
        logits = target(ids).logits[:, -1]  # [B, V]
        check_clear_of_nucleus_edges(logits, params)
        p = logits_to_probs(logits, params).double()  # [B, V]
        joint = (joint[:, None] * p).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(len(prefixes))[:, None]], dim=1)
    return joint.view(*[VOCAB] * DEPTH)


def check_clear_of_nucleus_edges(logits: torch.Tensor, params: SamplingParams) -> None:
    """Top-k and top-p decide membership by comparisons: a tie or a cumulative mass within rounding of top_p
    would let the batched enumeration and the cached decode disagree. Refuse such a set-up."""
    if params.top_k:
        values = (logits.double() / params.temperature).sort(dim=-1, descending=True).values
        if params.top_k < VOCAB:
            assert ((values[:, params.top_k - 1] - values[:, params.top_k]).abs() > 1e-4).all()
    if params.top_p < 1.0:
        warped = logits_to_probs(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
        mass_before = warped.double().sort(dim=-1, descending=True).values.cumsum(-1)
        assert ((mass_before - params.top_p).abs() > 1e-4).all()


def engine_samples(engine: Engine, prompt: list[int], params: SamplingParams, runs: int, first_seed: int = 0
                   ) -> torch.Tensor:
    """[runs, DEPTH] first generated tokens of ``Engine.generate`` with seeds first_seed, first_seed + 1, ..."""
    text = " ".join(map(str, prompt))
    out = []
    for run in range(runs):
        result = engine.generate(text, max_new_tokens=DEPTH, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, seed=first_seed + run, raw=True)
        out.append(result.token_ids)
    return torch.tensor(out)


def closing_engine_samples(engine: Engine, prompt: list[int], params: SamplingParams, runs: int) -> torch.Tensor:
    """:func:`engine_samples`, then the engine's overlap worker (if any) is closed: the engine was built for them."""
    try:
        return engine_samples(engine, prompt, params, runs)
    finally:
        if engine._worker is not None:
            engine._worker.close()


@dataclass
class Fit:
    p_values: dict[str, float]  # check -> chi-square p-value

    @property
    def worst(self) -> tuple[str, float]:
        return min(self.p_values.items(), key=lambda item: item[1])

    @property
    def lossless(self) -> bool:
        return self.worst[1] > MIN_P_VALUE


def fit(samples: torch.Tensor, joint: torch.Tensor) -> Fit:
    """Chi-square p-values of samples [N, DEPTH] against the exact joint [VOCAB] * DEPTH."""
    assert samples.shape[1] == DEPTH
    checks: dict[str, float] = {}
    for position in range(1, DEPTH):
        marginal = joint.sum(dim=tuple(d for d in range(DEPTH) if d != position))
        checks[f"token {position}"] = chi_square_p_value(torch.bincount(samples[:, position], minlength=VOCAB),
                                                         marginal)
    for first in (0, 1):
        positions = (first, first + 1, first + 2)
        triple = joint.sum(dim=tuple(d for d in range(DEPTH) if d not in positions)).flatten()  # [V ** 3]
        cells = (samples[:, first] * VOCAB + samples[:, first + 1]) * VOCAB + samples[:, first + 2]
        checks[f"tokens {positions}"] = chi_square_p_value(torch.bincount(cells, minlength=VOCAB ** 3), triple)
    return Fit(checks)


def assert_lossless(samples: torch.Tensor, joint: torch.Tensor) -> None:
    result = fit(samples, joint)
    assert result.lossless, f"not the target's distribution: {result.p_values}"


def assert_caught(samples: torch.Tensor, joint: torch.Tensor) -> None:
    """The companion of a lossless test: with a broken rule the same checks must reject."""
    result = fit(samples, joint)
    assert not result.lossless, f"a broken rule went unnoticed: {result.p_values}"




# --- broken rules, for the companions (each is NOT lossless at T > 0) ------------------------------------------


@contextlib.contextmanager
def broken(attribute: str, replacement: Callable) -> Iterator[None]:
    """Replace ``attribute`` (``verify_chain``, ``verify_tree``, ``logits_to_probs``) in every decode module that
    verifies with it: ``decode/step.py``, whose verdict every loop (single request, overlap, batch) uses."""
    import dflash2.decode.step as step

    with contextlib.ExitStack() as stack:
        for module in (step,):
            if hasattr(module, attribute):
                stack.enter_context(mock.patch.object(module, attribute, replacement))
        yield


def accept_the_argmax(draft_ids, p_target, q_draft, generator, *, uniforms=None) -> ChainVerdict:
    """BROKEN chain rule: accept a draft iff it is the target's argmax, then draw from p_target."""
    k = draft_ids.shape[1]
    accepted = draft_ids == p_target[:, :k].argmax(dim=-1)  # [batch, k]
    return _with_final_from_p(draft_ids, accepted.long().cumprod(dim=1).sum(dim=1), p_target, generator)


def drop_the_residual(draft_ids, p_target, q_draft, generator, *, uniforms=None) -> ChainVerdict:
    """BROKEN chain rule: the right acceptances, but the token after a rejection is drawn from p_target, not from
    the residual norm(max(p_target - q_draft, 0))."""
    verdict = verify_chain(draft_ids, p_target, q_draft, generator, uniforms=uniforms)
    return _with_final_from_p(draft_ids, verdict.num_accepted, p_target, generator)


def swap_p_and_q(draft_ids, p_target, q_draft, generator, *, uniforms=None) -> ChainVerdict:
    """BROKEN chain rule: p_target and q_draft swapped in the acceptance test and the residual (a deterministic
    draft's q is its one-hot)."""
    k = draft_ids.shape[1]
    if q_draft is None:
        q_draft = torch.nn.functional.one_hot(draft_ids, p_target.shape[-1]).to(p_target.dtype)
    return verify_chain(draft_ids, torch.cat([q_draft, p_target[:, k:]], dim=1), p_target[:, :k], generator,
                        uniforms=uniforms)


def _with_final_from_p(draft_ids, num_accepted, p_target, generator) -> ChainVerdict:
    rows = torch.arange(draft_ids.shape[0], device=draft_ids.device)
    final = sample(p_target[rows, num_accepted], generator)  # [batch]
    return ChainVerdict(num_accepted=num_accepted, tokens=chain_tokens(draft_ids, num_accepted, final))


def follow_the_argmax_child(layout, node_tokens, p_target, q_draft, generator, *, uniforms=None) -> TreeVerdict:
    """BROKEN tree rule: follow the child equal to the target's argmax; where none is, emit a draw from p_target."""
    tokens = node_tokens.tolist()
    accepted: list[int] = []
    position = 0
    while True:
        wanted = int(p_target[position].argmax())
        child = next((c for c in layout.children[position] if tokens[c] == wanted), None)
        if child is None:
            emitted = int(sample(p_target[position], generator))
            return TreeVerdict(accepted, torch.tensor([tokens[c] for c in accepted] + [emitted]))
        accepted.append(child)
        position = child + 1


def unwarped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """BROKEN warps: p_target without top-k / top-p (the warps must be applied before verification)."""
    return logits_to_probs(logits, SamplingParams(temperature=params.temperature))


__all__ = [
    "DEPTH", "DRAFT_VOCAB", "MIN_P_VALUE", "VOCAB", "IdTokenizer", "assert_caught", "broken", "assert_lossless",
    "closing_engine_samples", "engine_samples", "exact_joint", "fit", "tiny_drafter_model", "tiny_engine", "tiny_target", "accept_the_argmax",
    "drop_the_residual", "swap_p_and_q", "follow_the_argmax_child", "unwarped",
]
