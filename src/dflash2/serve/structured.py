"""Structured output and logprobs for one request: the constraint the batch engine applies at every target pass.

Grammars come from xgrammar (``pip install 'dflash2[grammar]'``), chosen over llguidance by mask cost on the
default target's 151,936-token vocabulary (AMD EPYC Zen 4, 2 cores, 2026-12-06: a JSON-schema mask per token 13 us
median / 21 us mean with xgrammar 0.2.9, 17 us / 77 us with llguidance 1.9.1; tokenizer set-up 1.5 s vs 4.7 s).
The mask is applied along the draft by ``verify/grammar.py`` (lossless: every verified row is masked as plain
constrained decoding masks it); the matcher advances only by emitted tokens, so it rolls back with the KV cache.

Logprobs are the target's raw log-softmax at each emitted token's position (before temperature, top-k / top-p and
the grammar mask, as OpenAI reports the model's own distribution), the same with and without drafts.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash2.drafters.base import Draft, Drafter
from dflash2.drafters.grammar import GrammarDrafter
from dflash2.verify.grammar import apply_bitmask, decided_rows, draft_masks

GRAMMAR_EXTRA = "pip install 'dflash2[grammar]'"
MAX_WHITESPACE = 24  # characters between two JSON elements (a newline and 4 levels of 4-space indent fit)


class GrammarUnavailable(RuntimeError):
    """The grammar engine is not installed."""


class XgrammarState:
    """``verify.grammar.GrammarState`` over an xgrammar ``GrammarMatcher``."""

    def __init__(self, compiled) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def fill_mask(self, out: torch.Tensor) -> None:  # out: [W] int32
        self.matcher.fill_next_token_bitmask(out[None], 0)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here (``drafters.grammar.DraftGrammar``): xgrammar's jump-forward
        tokens (the last left out where a longer token could extend it); none with an xgrammar without them."""
        find = getattr(self.matcher, "find_jump_forward_tokens", None)
        return [] if find is None else list(find())


class Grammars:
    """Compiles response formats and tool-call grammars for one tokenizer (built on first use: ~1.5 s for the
    default target's vocabulary; compiled grammars are cached by xgrammar)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self._args = (hf_tokenizer, vocab_size, sorted(stop_ids))
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise GrammarUnavailable(f"structured output needs the grammar extra: {GRAMMAR_EXTRA}") from None
                hf_tokenizer, vocab_size, stop_ids = self._args
                info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                               stop_token_ids=stop_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def json_schema(self, schema: dict[str, Any]):
        """A compiled grammar of JSON values of ``schema``. Whitespace between elements is free, so the target keeps
        its own layout (a drafter predicts it; forcing compact JSON on a model that indents cost the default
        target's drafts nearly all their acceptance), but bounded per gap, so that no whitespace can run on."""
        return self.compiler().compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True,
                                                   max_whitespace_cnt=MAX_WHITESPACE)

    def tool_call(self, tools: list[tuple[str, dict[str, Any]]]):
        """One ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` of one of ``tools`` (name,
        parameters schema): the Hermes format Qwen2.5's template asks for."""
        import xgrammar

        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False} for name, params in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        grammar = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                          xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
        return self.compiler().compile_grammar(grammar)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, most likely first


@dataclass
class RequestConstraint:
    """The batch engine's per-request constraint (``constrain`` / ``advance``): a grammar mask, logprobs, or both.
    Called from the engine's loop thread only; ``logprobs`` grows as tokens are emitted (the server reads the
    entries of the tokens its events carry)."""

    grammar: XgrammarState | None = None
    vocab: int = 0  # the grammar's vocabulary (the target's logits may be wider)
    top_logprobs: int | None = None  # None: no logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _draft: Draft | None = None
    _raw: torch.Tensor | None = None  # [n + 1, V] the last pass's raw logits (kept for logprobs)

    def constrain(self, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        self._draft = draft
        self._raw = logits if self.top_logprobs is not None else None
        if self.grammar is None or self.grammar.terminated():
            return logits
        masks = draft_masks(self.grammar, draft.tokens.tolist(), draft.parents, self.vocab)  # [n + 1, W]
        return apply_bitmask(logits, masks.to(logits.device))

    def guide(self, drafter: Drafter) -> Drafter:
        """The request's drafter proposing under its grammar (``decode.step.GuidesDrafts``): forced tokens drafted,
        forbidden ones not (proposals only: the output stays constrained plain decoding's)."""
        return drafter if self.grammar is None else GrammarDrafter(drafter, self.grammar)

    def advance(self, emitted: list[int]) -> None:
        draft = self._draft
        if self._raw is not None and draft is not None:
            rows = decided_rows(draft.tokens.tolist(), draft.parents, emitted)
            self.logprobs.extend(token_logprobs(self._raw[rows], emitted[: len(rows)], self.top_logprobs or 0))
        if self.grammar is not None:
            for token in emitted:
                if self.grammar.terminated():
                    break  # past the stop token: the output ends there
                if not self.grammar.accept(token):
                    raise RuntimeError(f"the grammar refused emitted token {token}: the mask was not applied")


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [m, V] raw target logits at the positions of ``tokens`` (m of them) -> their log-softmax entries."""
    # one row at a time: a reduction over one row may be split across threads differently when several rows come
    # at once, and the values must not depend on how many tokens a pass emitted (plain = speculative, bitwise)
    logp = torch.cat([torch.log_softmax(row[None].float(), dim=-1) for row in logits])  # [m, V]
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [m]
    if top:
        values, ids = logp.topk(top, dim=-1)  # [m, top]
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]
