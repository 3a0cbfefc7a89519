"""Drafters: ``auto`` (the one measured fastest for the target), ``none`` (plain decoding), ``ngram`` (prompt
lookup), ``model`` (an independent small model), ``dflash`` (a block drafter reading the target's hidden states;
needs a trained drafter directory), ``dflash+ngram`` (a long prompt-lookup match when there is one, the DFlash
block otherwise), ``dflash2`` and ``dflash2+ngram`` (the same with a DFlash2 drafter: path selector and dynamic
convolution).

A drafter is named by a spec, ``name[:[L+]k[xW]]`` (:class:`~dflash2.drafters.spec.DrafterSpec`). The drafters, each
with its builder and default draft length, are one table there (``DRAFTERS``): a new drafter is its module (a
:class:`~dflash2.drafters.base.Drafter` and a builder) and one line in it."""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import TYPE_CHECKING

from dflash2.lazy import lazy_names
from dflash2.platform import DraftHardware
from dflash2.drafters.spec import (
    BLOCK_DRAFTERS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DRAFTER_NAMES,
    AUTO_DRAFTERS,
    AutoDrafter,
    HYBRID_SUFFIX,
    DraftOptions,
    DrafterSpec,
    DraftTarget,
    default_drafter,
    default_num_draft_tokens,
    drafter_kind,
)

if TYPE_CHECKING:
    from dflash2.drafters.base import Draft, Drafter
    from dflash2.drafters.dflash import TRAINED_DIR, shipped_dflash_drafter

__getattr__ = lazy_names(__name__, {  # (their modules import torch: dflash2.lazy)
    "Draft": "dflash2.drafters.base", "Drafter": "dflash2.drafters.base", "TRAINED_DIR": "dflash2.drafters.dflash",
    "shipped_dflash_drafter": "dflash2.drafters.dflash"}, globals())


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
    options = DraftOptions(replace(spec, name=spec.name.removesuffix(HYBRID_SUFFIX)),
                           spec.num_draft_tokens or default_num_draft_tokens(spec.name), draft_model, dtype, weights,
                           pull, hardware)
    module, _, function = drafter_kind(spec.name).build.partition(":")
    drafter = getattr(importlib.import_module(module), function)(target, options)
    if not spec.name.endswith(HYBRID_SUFFIX):
        return drafter
    from dflash2.drafters.hybrid import HybridDrafter

    # k sets the drafter's drafts; a prompt-lookup match may run as long as the n-gram drafter's
    lookup = max(drafter.num_draft_tokens, default_num_draft_tokens("ngram"))
    return HybridDrafter(drafter, lookup, stop_ids=target.tokenizer.eos_token_ids)


__all__ = ["AUTO_DRAFTERS", "AutoDrafter", "BLOCK_DRAFTERS", "DEFAULT_NUM_DRAFT_TOKENS", "DRAFTER_NAMES", "Draft",
           "DraftHardware", "DraftOptions", "DraftTarget", "Drafter", "DrafterSpec", "TRAINED_DIR", "build_drafter",
           "default_drafter", "default_num_draft_tokens", "shipped_dflash_drafter"]
