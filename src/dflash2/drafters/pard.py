"""PARD: a small pretrained model of the target's family drafts k tokens in ONE forward (arXiv 2504.18583).

Input of a draft pass: the tokens accepted since the drafter's last pass (the pending token last), then k - 1
mask tokens. The pending token's output is draft 1 (an ordinary next-token prediction); mask position j's output
is draft j + 1. The drafter keeps its own KV cache of the committed sequence (rolled back to the longest prefix
it shares with the committed sequence, as the ``model`` drafter); the mask positions' keys/values are written
past the committed slots and forgotten after the pass (the cache length is set back), so the next pass
overwrites them.

The mask token: the id ``vocab_size - 1`` of the Qwen2.5 vocabulary (151935, an embedding row the tokenizer
never produces: the tokenizer has 151665 ids), whose embedding is a LEARNED vector (``mask_embedding``, stored
with the adapter; before training: the mean of the base embeddings). The mask id is never drafted (its logit is
set to -inf).

Drafts at T > 0 are sampled independently per position from ``q_draft[j] = warp(logits_j)``; position j's
distribution does not depend on the drafts before it (they are not an input), so it is its conditional
distribution and the chain verification stays exact (lossless). At T = 0 the drafts are the argmaxes.

What training changes (``dflash2 train pard``) is small and shipped alone: LoRA adapters on the projections of
every layer (drafters/lora.py) and the mask embedding (``adapter.safetensors`` + ``pard_config.json``); the base
network comes from the model store. Loading merges the adapters into the weights (no extra cost per draft pass;
drafters/pard_load.py, which keeps the merged, converted network in the store).

``pard:L+k`` drafts L lead tokens first, one pass each (:class:`PardDrafter`); ``pard:L+kxW`` a tree over L + 1
passes (drafters/pard_tree.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash2 import platform
from dflash2.drafters.base import Draft, node_depths
from dflash2.drafters.dflash2_parts import best_tree
from dflash2.drafters.model import CachedModelDrafter, ContextWindow
from dflash2.drafters.pard_load import (  # the adapter's files and the network's loading, re-exported
    ADAPTER_FILE,
    BLOCK_FORMATS,
    DRAFT_VOCAB_FILE,
    PARD_CONFIG,
    Q4_0,
    Q8_0,
    PardConfig,
    VocabSubsetHead,
    default_mask_token_id,
    initial_mask_embedding,
    load_pard_model,
    load_pard_networks,
    read_draft_vocab,
    reading_twin,
)
from dflash2.drafters.pard_tree import Candidates, lead_tree, top_candidates
from dflash2.models.decoder import SegmentedAttention, Transformer
from dflash2.platform import DraftHardware
from dflash2.verify.sampling import SamplingParams, greedy_ids, logits_to_probs, sample

__all__ = ["ADAPTER_FILE", "BLOCK_FORMATS", "DRAFT_VOCAB_FILE", "PARD_CONFIG", "Q4_0", "Q8_0", "SHIPPED_DIR",
           "PardConfig", "PardDrafter", "VocabSubsetHead", "build_pard", "build_pard_drafter", "default_mask_token_id",
           "initial_mask_embedding", "load_pard_model", "load_pard_networks", "pard_catch_up",
           "pard_context_window", "pard_reader", "pard_weights", "propose_batch", "read_draft_vocab", "reading_twin"]

SHIPPED_DIR = Path(__file__).parent / "trained"  # dflash2.drafters.TRAINED_DIR (not imported: no import cycle)


def build_pard_drafter(target, draft_model: str | Path | None, num_draft_tokens: int | None, *, dtype: str = "bf16",
                       weights: str | None = None, pull: bool = True, num_paths: int = 1,
                       lead_tokens: int = 0, hardware: DraftHardware | None = None) -> PardDrafter:
    """The PARD drafter for ``target`` (a :class:`~dflash2.drafters.DraftTarget`): ``draft_model`` is a trained
    adapter directory (``pard_config.json``), or a store model / model directory drafting untrained (mask embedding
    = the mean embedding: only draft 1 is useful); None = the adapter shipped for the target
    (``drafters/trained/<target>-pard``). ``lead_tokens`` L: L drafts one per pass before the k-token pass (the
    drafter then drafts L + k). ``hardware``: how the kernels here would run it (the weight format and reader
    defaults; None: :func:`dflash2.kernels.profile.draft_hardware`). Refuses a base whose tokenizer differs from the
    target's."""
    from dflash2.models.store import canonical_name, resolve_model

    if draft_model is None:
        draft_model = SHIPPED_DIR / f"{canonical_name(target.name) or target.name}-pard"
        if not (draft_model / PARD_CONFIG).exists():
            raise ValueError(f"no trained pard drafter is shipped for {target.name!r}; train one with `dflash2 train "
                             f"pard` and pass its drafter/ directory (or a store model, untrained) as --draft-model")
    adapter = Path(draft_model) if (Path(draft_model) / PARD_CONFIG).exists() else None
    base = PardConfig.load(adapter).base_model if adapter is not None else str(draft_model)
    base_dir = resolve_model(base, dtype, pull=pull)
    if not target.tokenizer.same_vocabulary(base_dir):
        raise ValueError(f"pard base {base!r} has a different tokenizer from the target; it cannot draft for it")
    device = str(target.target.device)
    hardware = hardware or _hardware()
    model, config, reader = load_pard_networks(adapter, base_dir, dtype, device,
                                               weights=pard_weights(weights, device, dtype, hardware),
                                               reader=pard_reader(hardware))
    k = num_draft_tokens or config.default_num_draft_tokens or config.num_draft_tokens
    return PardDrafter(model, config.mask_token_id, lead_tokens + k, target_vocab_size=target.target.config.vocab_size,
                       num_paths=num_paths, context_window=pard_context_window(), catch_up=pard_catch_up(),
                       lead_tokens=lead_tokens, reader=reader)


def build_pard(target, options) -> PardDrafter:
    """``pard[:[L+]k[xW]]`` from the drafter table (drafters/spec.py): :func:`build_pard_drafter` with the options
    of :func:`dflash2.drafters.build_drafter` (a :class:`~dflash2.drafters.DraftOptions`)."""
    return build_pard_drafter(target, options.draft_model, options.num_draft_tokens, dtype=options.dtype,
                              weights=options.weights, pull=options.pull, num_paths=options.spec.width,
                              lead_tokens=options.spec.lead, hardware=options.hardware)


def _hardware() -> DraftHardware:
    """This machine's kernels, no target (for a caller that passes none)."""
    from dflash2.kernels.profile import draft_hardware

    return draft_hardware()


def pard_reader(hardware: DraftHardware | None = None) -> bool:
    """Whether a drafter in Q8_0 / Q4_0 blocks also keeps a bf16 twin for reading prompts (:func:`reading_twin`):
    where the packed bf16 kernel runs on AMX tiles (``hardware.bf16_on_amx``, measured there), unless
    ``$DFLASH2_PARD_READER`` = ``none`` (it costs 2 bytes per projection weight: ~0.7 GB for the 0.5B). Lossless
    either way (only the drafts' context is computed differently)."""
    profile = platform.settings()
    profile.check("DFLASH2_PARD_READER")
    if profile.pard_reader is not None:
        return profile.pard_reader == "bf16"
    return (hardware or _hardware()).bf16_on_amx()


def pard_catch_up() -> int | None:
    """How many of the ids it missed a drafter that fell behind reads before drafting: :data:`DEFAULT_CATCH_UP`,
    or ``$DFLASH2_PARD_CATCH_UP`` = N or ``all``. Lossless either way (only the drafts' context shrinks)."""
    profile = platform.settings()
    profile.check("DFLASH2_PARD_CATCH_UP")
    if profile.pard_catch_up is None:
        return DEFAULT_CATCH_UP
    return None if profile.pard_catch_up == "all" else int(profile.pard_catch_up)


def pard_context_window() -> ContextWindow | None:
    """How much of a long prompt the drafter reads: :data:`DEFAULT_CONTEXT_WINDOW`, or ``$DFLASH2_PARD_WINDOW`` =
    ``SINK,RECENT`` (the first SINK and the last RECENT ids of a prompt past 512 ids and past the window) or
    ``all``. Lossless either way (only the drafts' context shrinks); it bounds the drafter's reading time."""
    profile = platform.settings()
    profile.check("DFLASH2_PARD_WINDOW")
    if profile.pard_window is None:
        return DEFAULT_CONTEXT_WINDOW
    if profile.pard_window == "all":
        return None
    return ContextWindow(*profile.pard_window, whole=DEFAULT_CONTEXT_WINDOW.whole)


def pard_weights(weights: str | None, device: str, dtype: str = "bf16", hardware: DraftHardware | None = None) -> str:
    """The drafter's weight format: ``weights`` when quantized (``--weights int8 / int4`` quantizes target and
    drafter), else for bf16 / fp16 / gguf on a CPU (``$DFLASH2_PARD_WEIGHTS`` = bf16 / int8 / int4 / q8_0 / q4_0
    overrides it), where a C++ build of the gguf kernel runs (AVX2, AVX512-VNNI or AMX-INT8; its layers run as one
    call each): :data:`Q4_0` under a gguf target (the target's own bytes per weight: a 3-row draft pass 22 vs 30 ms
    in Q8_0, acceptance unchanged within noise, AMD EPYC Zen 4, docs/pard.md), :data:`Q8_0` under a bf16 target
    (a 3-row pass 23-26 vs 28-33 ms in int8 there); on the AVX2-only AMD EPYC Zen 3 a 3-drafts pass took 24-30 ms
    in Q4_0, 29-35 in Q8_0 and 40-53 in int8 (2026-12-07, docs/pard.md). Else (the gguf kernel's PyTorch
    reference) :data:`DEFAULT_PARD_WEIGHTS`. Not quantized elsewhere (fp32 stays the unquantized reference, as
    ``load_transformer``). The blocks are quantized from the base merged with the adapter, which no GGUF file
    holds. ``hardware``: which gguf kernel runs here (None: :func:`dflash2.kernels.profile.draft_hardware`)."""
    if weights not in (None, "bf16", "gguf"):
        return weights
    if torch.device(device).type != "cpu" or dtype == "fp32":
        return "bf16"
    profile = platform.settings()
    profile.check("DFLASH2_PARD_WEIGHTS")
    if profile.pard_weights is not None:
        return profile.pard_weights
    if not _gguf_kernel_runs(hardware or _hardware(), gguf_target=weights == "gguf"):
        return DEFAULT_PARD_WEIGHTS
    return Q4_0 if weights == "gguf" else Q8_0


def _gguf_kernel_runs(hardware: DraftHardware, gguf_target: bool) -> bool:
    """The gguf kernel chosen here is one of its C++ builds, not the PyTorch reference (on Intel AMX a 5-row pass of
    the 0.5B under a gguf target: Q4_0 29 ms, Q8_0 32 ms, int8 on AMX tiles 35 ms; 2026-12-04, docs/pard.md). Under
    a gguf target a kernel that cannot run is the target's error; under another target it only means the int8
    default."""
    try:
        return hardware.gguf_backend() in ("avx2", "avx512-vnni", "amx-int8")
    except (RuntimeError, ValueError):  # no gguf kernel here, or a bad DFLASH2_GGUF_KERNEL
        if gguf_target:
            raise
        return False


# int8 on a CPU: one draft pass of the 0.5B (8 rows) measured 590 ms vs 669 ms in bf16 (scripts/pard_cost.py,
# docs/pard.md); the drafts need not be exact, only verification must (and it is, whatever the drafter computes)
DEFAULT_PARD_WEIGHTS = "int8"
# The drafter reads a prompt of up to 512 ids whole; of a longer one its first 16 ids (the chat template's system
# turn, attention sinks) and its last 112: on 6-7.5K-id prompts that drafts as well as 32 + 480 and reads ~0.6 s
# less (docs/pard.md, "Reading prompts, catching up, long prompts"). None reads all of every prompt.
DEFAULT_CONTEXT_WINDOW: ContextWindow | None = ContextWindow(16, 112, whole=512)
# A drafter that fell behind (speculation off for a while, or prompt lookup drafting) reads only the last 8 ids it
# missed: a probe after 100 plain steps then costs about a usual pass (docs/pard.md, "Catching up").
DEFAULT_CATCH_UP: int | None = 8


# ---- the drafter -----------------------------------------------------------------------------------------


class PardDrafter(CachedModelDrafter):
    """k drafts per forward of a small model: accepted tokens + k - 1 mask tokens (see the module docstring).

    With ``lead_tokens`` L > 0 (``pard:L+k``) a step first drafts L tokens one per pass (each an ordinary
    next-token prediction: the pass reads the ids it has not read and outputs one row), then the last k from one
    pass that reads the L lead tokens as context. The lead tokens are the positions PARD drafts best (the first
    one; the masks' acceptance falls with distance), so the k-token pass starts further ahead. In a tree
    (``pard:L+kxW``) every pass drafts k positions and the tree hangs each node's children from the pass that
    knew its parent (drafters/pard_tree.py). Lossless as before: each draft is drawn from a distribution given
    the drafts before it only (the lead tokens sampled with their q_draft at T > 0; a tree's nodes are
    deterministic, verified by the tree rule)."""

    name = "pard"
    cost_per_pass = True

    def __init__(self, model: Transformer, mask_token_id: int, num_draft_tokens: int = 8,
                 target_vocab_size: int | None = None, num_paths: int = 1,
                 context_window: ContextWindow | tuple[int, int] | None = None, catch_up: int | None = None,
                 lead_tokens: int = 0, reader: Transformer | None = None) -> None:
        super().__init__(model, num_draft_tokens, target_vocab_size, context_window, catch_up, reader)
        if num_paths < 1:
            raise ValueError(f"num_paths must be >= 1, got {num_paths}")
        if not 0 <= lead_tokens < num_draft_tokens:
            raise ValueError(f"lead_tokens must be in [0, num_draft_tokens = {num_draft_tokens}), got {lead_tokens}")
        self.mask_token_id = mask_token_id
        self.num_paths = num_paths  # W > 1: a deterministic tree of k * W nodes (pard:kxW)
        self.lead_tokens = lead_tokens  # L: drafts made one per pass before the parallel pass (pard:L+k)

    @property
    def extra_slots(self) -> int:
        """Room for the mask positions a draft pass writes past the committed sequence."""
        return self.num_draft_tokens + 1

    @property
    def max_draft_tokens(self) -> int:
        """Nodes of the largest draft: one chain, or the lead and a tree of ``num_paths`` times the rest."""
        return self.lead_tokens + (self.num_draft_tokens - self.lead_tokens) * self.num_paths

    def for_request(self) -> PardDrafter:
        """The same network (weights shared), its own KV cache."""
        return PardDrafter(self.model, self.mask_token_id, self.num_draft_tokens, self.target_vocab_size,
                           self.num_paths, self.context_window, self.catch_up, self.lead_tokens, self.reader)

    def drafted_by_shared_pass(self) -> None:
        """(A pard drafter keeps no step counters; a hybrid over it does.)"""

    def shared_pass(self, sequence: list[int], num_draft_tokens: int) -> tuple[PardDrafter, int] | None:
        """A chain's single pass can share one forward with other requests' (:func:`propose_batch`); a tree's or a
        lead's passes cannot."""
        return (self, num_draft_tokens) if self.num_paths == 1 and not self.lead_tokens else None

    @staticmethod
    def propose_batch(requests):  # see drafters/base.py, BatchesPasses
        return propose_batch(requests)

    @torch.inference_mode()
    def draft_logits(self, sequence: list[int], num_draft_tokens: int) -> torch.Tensor:
        """[k, V_target] float32 logits of drafts 1..k after ``sequence``, from one forward; the cache keeps the
        committed ids only."""
        return self._head(self._pass_hidden(sequence, num_draft_tokens))

    def _pass_hidden(self, sequence: list[int], num_draft_tokens: int) -> torch.Tensor:
        """One draft pass -> [k, D]: the pending token's output and the masks' (the last layer's, before the norm)."""
        feed = self._prepare_pass(sequence, num_draft_tokens)
        device = self.model.device
        out = self.model(torch.tensor([feed.ids], device=device), torch.tensor([feed.positions], device=device),
                         cache=self.cache, hidden_layers=(self.model.config.num_layers - 1,), logits="none")
        hidden = out.hidden_states[0][0, feed.draft_rows]  # [k, D]
        self._finish_pass(sequence, feed)
        return hidden

    def _prepare_pass(self, sequence: list[int], num_draft_tokens: int) -> PassFeed:
        """Sync the cache with ``sequence`` and lay out the pass: the ids it has not read, then k - 1 masks."""
        assert self.cache is not None, "reset() must be called before propose()"
        self._sync(sequence)
        if not self.slot_ids and self.context_window is not None:  # not prefilled: the window applies
            self._read_into_cache(sequence[:-1])
        read = self._unread_positions(sequence)  # ids the draft cache has not read yet (>= 1)
        masks = list(range(len(sequence), len(sequence) + num_draft_tokens - 1))
        return PassFeed(ids=[sequence[p] for p in read] + [self.mask_token_id] * len(masks), positions=read + masks,
                        read=read, start=self.cache.length)

    def _finish_pass(self, sequence: list[int], feed: PassFeed) -> None:
        """After the forward: forget the mask positions' slots, mark the read ids as held."""
        self.cache.rollback(feed.start + len(feed.read))
        self._mark_read(sequence, feed.read)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [k, D] -> [k, V_target] float32 logits, the mask id never drafted."""
        return self._to_target(self._head_part(hidden))

    def _head_part(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [k, D] -> [k, V'] float32 logits over the head's own rows: the draft vocabulary (ascending ids),
        else the whole vocabulary with the mask id at -inf."""
        normed = self.model.norm(hidden)
        head = self.model.lm_head
        if isinstance(head, VocabSubsetHead):
            return head.part(normed)
        logits = self.model.float_logits(normed)  # [k, V_draft]
        logits[:, self.mask_token_id] = float("-inf")
        return logits

    def _to_target(self, part: torch.Tensor) -> torch.Tensor:
        """[k, V'] logits over the head's rows -> [k, V_target] (-inf at ids the head does not draft)."""
        head = self.model.lm_head
        return self._to_target_vocab(head.expand(part) if isinstance(head, VocabSubsetHead) else part)

    def _draft_from_part(self, part: torch.Tensor, params: SamplingParams, generator) -> Draft:
        """The draft from the head's logits [k, V']: a tree, or a greedy chain over a draft vocabulary, from the
        head's rows mapped to ids (no [k, V_target] logits: the same tokens, ties to the lowest id as there);
        otherwise :meth:`_draft` on the target vocabulary."""
        head = self.model.lm_head
        if self.num_paths > 1 and (not isinstance(head, VocabSubsetHead) or head.vocab_size <= self.target_vocab_size):
            return self._tree(part)
        if (self.num_paths == 1 and params.greedy and isinstance(head, VocabSubsetHead)
                and head.vocab_size <= self.target_vocab_size):
            rows = greedy_ids(part)  # [k]
            return Draft(tokens=head.ids[rows].cpu(), q_draft=None, confidence=probabilities(part, rows))
        return self._draft(self._to_target(part), params, generator)

    @torch.inference_mode()
    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        lead = min(self.lead_tokens, num_draft_tokens - 1)
        if not lead:
            return self._draft_from_part(self._head_part(self._pass_hidden(sequence, num_draft_tokens)), params,
                                         generator)
        if self.num_paths > 1:
            return self._lead_tree(sequence, lead, num_draft_tokens - lead)
        sequence = list(sequence)  # the lead tokens are appended to a copy
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(lead):  # one pass per lead token: the ids not read yet, no masks
            token, q = self._lead_token(self._head_part(self._pass_hidden(sequence, 1)), params, generator)
            tokens.append(token)
            sequence.append(token)
            if q is not None:
                dists.append(q)
        rest = self._draft_from_part(self._head_part(self._pass_hidden(sequence, num_draft_tokens - lead)), params,
                                     generator)
        return _after_lead(tokens, dists, rest)

    def _lead_tree(self, sequence: list[int], lead: int, k: int) -> Draft:
        """A tree of lead + k * W deterministic nodes from lead + 1 passes of k drafts each: pass s + 1 reads pass
        s's top draft 1 (a lead token), and the children of that node come from pass s + 1 (:func:`lead_tree`)."""
        sequence = list(sequence)
        passes: list[Candidates] = []
        for _ in range(lead):
            passes.append(top_candidates(self._head_part(self._pass_hidden(sequence, k))))
            sequence.append(self._head_id(passes[-1].rows[0][0]))  # the lead token: draft 1's top candidate
        passes.append(top_candidates(self._head_part(self._pass_hidden(sequence, k))))
        rows, parents = lead_tree(passes, lead + k * self.num_paths)
        return Draft(tokens=torch.tensor([self._head_id(row) for row in rows], dtype=torch.int64), q_draft=None,
                     parents=parents)

    def _head_id(self, row: int) -> int:
        """The token id of the head's row ``row`` (a draft vocabulary's, or the full vocabulary's: the same)."""
        head = self.model.lm_head
        return int(head.ids[row]) if isinstance(head, VocabSubsetHead) else row

    def _lead_token(self, part: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """part [1, V'] -> a lead token of a chain and its q_draft [V] (None at T = 0: the argmax)."""
        if params.greedy:
            return self._head_id(int(greedy_ids(part)[0])), None
        q = logits_to_probs(self._to_target(part)[0], params)  # [V]
        return int(sample(q, generator)), q

    def _tree(self, logits: torch.Tensor, head_rows: bool = True) -> Draft:
        """The best-first tree of k * W nodes through logits [k, V'] (:func:`best_tree`) over the head's rows
        (``head_rows``) or the target's ids: deterministic nodes, verified by the exact tree rule at T > 0 too
        (lossless)."""
        rows, parents = best_tree(None, logits, logits, 0, len(logits) * self.num_paths)
        chosen = torch.tensor(rows, dtype=torch.int64)
        head = self.model.lm_head
        tokens = head.ids[chosen].cpu() if head_rows and isinstance(head, VocabSubsetHead) else chosen
        return Draft(tokens=tokens, q_draft=None, parents=parents,
                     confidence=probabilities(logits, chosen, [depth - 1 for depth in node_depths(parents)]))

    def _draft(self, logits: torch.Tensor, params: SamplingParams, generator) -> Draft:
        """logits [k, V] -> the draft: a tree (``num_paths`` > 1), the argmaxes (T = 0) or samples with q_draft."""
        if self.num_paths > 1:
            return self._tree(logits, head_rows=False)
        if params.greedy:
            rows = greedy_ids(logits)
            return Draft(tokens=rows.cpu(), q_draft=None, confidence=probabilities(logits, rows))
        q_draft = logits_to_probs(logits, params)  # [k, V]: each position's own distribution
        tokens = sample(q_draft, generator).to(torch.int64)
        return Draft(tokens=tokens.cpu(), q_draft=q_draft,
                     confidence=q_draft.gather(1, tokens[:, None].to(q_draft.device))[:, 0].float().cpu())


def probabilities(logits: torch.Tensor, rows: torch.Tensor, lines: list[int] | None = None) -> torch.Tensor:
    """logits [k, V'] and, for each of n drafts, its row ``rows`` [n] on line ``lines[i]`` (None: line i) -> [n]
    float32 softmax probabilities of those rows (the drafter's confidence in each draft, ``Draft.confidence``).
    Each line is normalised once, however many of a tree's nodes sit on it."""
    logits = logits.float()
    index = torch.arange(len(rows)) if lines is None else torch.tensor(lines, dtype=torch.int64)
    index = index.to(logits.device)
    chosen = logits[index, rows.to(logits.device)]  # [n]
    return (chosen - logits.logsumexp(dim=-1)[index]).exp().cpu()


def _after_lead(lead: list[int], dists: list[torch.Tensor], rest: Draft) -> Draft:
    """A chain's lead tokens followed by the last pass's chain."""
    tokens = torch.cat([torch.tensor(lead, dtype=torch.int64), rest.tokens.to(torch.int64).cpu()])
    if rest.q_draft is None:
        return Draft(tokens=tokens, q_draft=None)
    return Draft(tokens=tokens, q_draft=torch.cat([torch.stack(dists), rest.q_draft]))  # [L + k, V]


@dataclass
class PassFeed:
    """One draft pass's input: the ids the cache has not read (at their positions), then the mask positions."""

    ids: list[int]
    positions: list[int]
    read: list[int]  # positions of the committed ids read by this pass (the pending one last)
    start: int  # the cache's length before the pass

    @property
    def draft_rows(self) -> slice:
        """The rows whose outputs are the drafts: the pending token's, then the masks'."""
        return slice(len(self.read) - 1, len(self.ids))


@torch.inference_mode()
def propose_batch(requests: list[tuple[PardDrafter, list[int], int, SamplingParams, torch.Generator | None]]
                  ) -> list[Draft]:
    """Draft for several requests whose drafters share one network in ONE forward: each request's pass is a
    segment of the token axis attending to its own cache (``SegmentedAttention``), so the weights are read once
    for all of them. Each draft equals that drafter's own ``propose``: bit for bit where the kernels are
    row-invariant (bf16 and GGUF blocks on CPU), to rounding otherwise (PyTorch's fp32 matmul).

    ``requests``: (drafter, committed sequence, k, sampling parameters, generator) per request."""
    if len(requests) == 1:
        drafter, sequence, k, params, generator = requests[0]
        return [drafter.propose(sequence, k, params, generator)]
    first = requests[0][0]
    model = first.model
    if any(d.model is not model or d.num_paths > 1 or d.lead_tokens or d.mask_token_id != first.mask_token_id
           or d.target_vocab_size != first.target_vocab_size for d, *_ in requests):
        raise ValueError("propose_batch needs chain drafters sharing one network, mask id and target vocabulary")
    feeds = [drafter._prepare_pass(sequence, k) for drafter, sequence, k, _, _ in requests]
    device = model.device
    ids = torch.tensor([[i for feed in feeds for i in feed.ids]], device=device)  # [1, N]
    positions = torch.tensor([[p for feed in feeds for p in feed.positions]], device=device)  # [1, N]
    drafters = [drafter for drafter, *_ in requests]
    context = SegmentedAttention([drafter.cache for drafter in drafters], [len(feed.ids) for feed in feeds])
    try:
        out = model(ids, positions, hidden_layers=(model.config.num_layers - 1,), logits="none", context=context)
        segments = out.hidden_states[0][0].split([len(feed.ids) for feed in feeds])  # per request [T_i, D]
        hidden = torch.cat([segment[feed.draft_rows] for segment, feed in zip(segments, feeds)])  # [sum k, D]
        parts = drafters[0]._head_part(hidden).split([k for _, _, k, _, _ in requests])  # per request [k, V']
    except BaseException:  # leave each cache as a pass alone expects it (the engine then drafts them one by one)
        for drafter, feed in zip(drafters, feeds):
            drafter.cache.rollback(feed.start)
        raise
    for drafter, feed, (_, sequence, *_) in zip(drafters, feeds, requests):
        drafter._finish_pass(sequence, feed)
    return [drafter._draft_from_part(part, params, generator)
            for drafter, part, (_, _, _, params, generator) in zip(drafters, parts, requests)]
