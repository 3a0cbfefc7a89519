"""Drafters: ``auto`` (the one measured fastest for the target), ``none`` (plain decoding), ``ngram`` (prompt
lookup), ``model`` (an independent small model), ``dflash`` (a block drafter reading the target's hidden states;
needs a trained drafter directory), ``dflash+ngram`` (a long prompt-lookup match when there is one, the DFlash
block otherwise), ``dflash2`` and ``dflash2+ngram`` (the same with a DFlash2 drafter: path selector and dynamic
convolution).

A drafter is named by a spec, ``name[:[L+]k[xW]]`` (:class:`~dflash2.drafters.spec.DrafterSpec`); default draft lengths
are in one table there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash2.drafters.base import Draft, Drafter
from dflash2.platform import DraftHardware
from dflash2.drafters.spec import (
    BLOCK_DRAFTERS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DRAFTER_NAMES,
    AUTO_DRAFTERS,
    AutoDrafter,
    DrafterSpec,
    default_drafter,
    default_num_draft_tokens,
)

if TYPE_CHECKING:
    from dflash2.models.decoder import Transformer
    from dflash2.models.tokenizer import Tokenizer

TRAINED_DIR = Path(__file__).parent / "trained"  # trained drafters shipped with the package, one per target


@dataclass(frozen=True)
class DraftTarget:
    """What building a drafter needs from the target (an :class:`~dflash2.decode.engine.Engine` has the same three
    attributes, so either may be passed to :func:`build_drafter`)."""

    target: Transformer  # the model the drafter drafts for (block drafters read its hidden states, embeddings, head)
    tokenizer: Tokenizer  # its EOS ids stop n-gram drafts; a draft model must share its fingerprint
    name: str = ""  # the target's store name, alias or path: picks "auto" and the shipped or paired drafter


def build_drafter(spec: str | DrafterSpec, target: DraftTarget, *, draft_model: str | None = None,
                  num_draft_tokens: int | None = None, num_candidates: int | None = None, dtype: str = "bf16",
                  weights: str = "bf16", pull: bool = True, serving: bool = False,
                  hardware: DraftHardware | None = None) -> Drafter:
    """Build the drafter ``spec`` (``name[:[L+]k[xW]]``, see :mod:`dflash2.drafters.spec`) for ``target``'s model.

    ``num_draft_tokens`` / ``num_candidates`` set k / W when the spec does not (ValueError when both set them
    differently). ``serving``: ``auto`` means what it means in the batch server. ``hardware``: how the kernels
    here run the target, for the defaults (None: :func:`dflash2.kernels.profile.draft_hardware` of the target).
    Refuses a draft model whose tokenizer differs.
    """
    if hardware is None:
        from dflash2.kernels.profile import draft_hardware
        from dflash2.models.calibration import calibrated

        hardware = draft_hardware(target.target)
        if not serving and DrafterSpec.parse(spec).name == "auto":  # a tree or a chain: measured where asked
            hardware = calibrated(hardware, target.target)
    spec = DrafterSpec.parse(spec).merge(num_draft_tokens, num_candidates).resolved(
        target.name, serving=serving, hardware=hardware)
    if not spec.drafts:
        raise ValueError("drafter 'none' is plain decoding: there is no drafter to build")
    name, width = spec.name, spec.width
    k = spec.num_draft_tokens or default_num_draft_tokens(name)  # None for block drafters: their directory's own
    if name == "ngram":
        from dflash2.drafters.ngram import NgramDrafter

        return NgramDrafter(k, stop_ids=target.tokenizer.eos_token_ids, num_candidates=width)
    if name == "model":
        if width > 1:
            raise ValueError(f"drafter {str(spec)!r}: the model drafter drafts a chain (one token per pass); it "
                             f"takes no tree width W")
        from dflash2.drafters.model import ModelDrafter
        from dflash2.models.loading import load_transformer
        from dflash2.models.store import default_draft, resolve_model

        ref = draft_model or default_draft(target.name)
        if ref is None:
            raise ValueError(f"no default draft model for {target.name!r}; pass draft_model / --draft-model")
        draft_dir = resolve_model(ref, dtype, pull=pull)
        if not target.tokenizer.same_vocabulary(draft_dir):
            raise ValueError(f"draft model {ref!r} has a different tokenizer from the target; it cannot draft for it")
        model = load_transformer(draft_dir, dtype, target.target.device, weights=weights)
        return ModelDrafter(model, k, target_vocab_size=target.target.config.vocab_size)
    from dflash2.drafters.hybrid import HybridDrafter

    if name in ("pard", "pard+ngram"):  # a trained adapter directory or a store model (untrained); docs/pard.md
        from dflash2.drafters.pard import build_pard_drafter

        pard = build_pard_drafter(target, draft_model, k, dtype=dtype, weights=weights, pull=pull, num_paths=width,
                                  lead_tokens=spec.lead, hardware=hardware)
        if name == "pard":
            return pard
        lookup = max(pard.num_draft_tokens, default_num_draft_tokens("ngram"))
        return HybridDrafter(pard, lookup, stop_ids=target.tokenizer.eos_token_ids)
    from dflash2.drafters.conditioning import has_conditioning
    from dflash2.drafters.dflash import load_dflash_drafter

    kind = name.partition("+")[0]  # a block drafter (BLOCK_DRAFTERS)
    if kind == "dflash2" and draft_model is not None and has_conditioning(draft_model):
        # the pretrained 0.5B's PARD adapter reading the target's hidden states (drafters/conditioned.py)
        from dflash2.drafters.conditioned import build_conditioned_drafter

        block = build_conditioned_drafter(target, draft_model, k, dtype=dtype, weights=weights, pull=pull,
                                          num_paths=width)
    else:
        directory = draft_model or shipped_dflash_drafter(target.name, kind)
        # W > 1: a tree of k * W nodes through the block's top candidates
        block = load_dflash_drafter(directory, target.target, k, num_paths=width)
    if not name.endswith("+ngram"):
        return block
    # k sets the block's drafts; a prompt-lookup match may run as long as the n-gram drafter's
    lookup = max(block.num_draft_tokens, default_num_draft_tokens("ngram"))
    return HybridDrafter(block, lookup, stop_ids=target.tokenizer.eos_token_ids)


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


__all__ = ["AUTO_DRAFTERS", "AutoDrafter", "BLOCK_DRAFTERS", "DEFAULT_NUM_DRAFT_TOKENS", "DRAFTER_NAMES", "Draft",
           "DraftHardware", "DraftTarget", "Drafter", "DrafterSpec", "TRAINED_DIR", "build_drafter", "default_drafter",
           "default_num_draft_tokens", "shipped_dflash_drafter"]
