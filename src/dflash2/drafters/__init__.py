"""Drafters: ``auto`` (the one measured fastest for the target), ``none`` (plain decoding), ``ngram`` (prompt
lookup), ``model`` (an independent small model), ``dflash`` (a block drafter reading the target's hidden states;
needs a trained drafter directory), ``dflash+ngram`` (a long prompt-lookup match when there is one, the DFlash
block otherwise), ``dflash2`` and ``dflash2+ngram`` (the same with a DFlash2 drafter: path selector and dynamic
convolution)."""

from __future__ import annotations

from pathlib import Path

from dflash2.drafters.base import Draft, Drafter

TRAINED_DIR = Path(__file__).parent / "trained"  # trained drafters shipped with the package, one per target

DRAFTER_NAMES = ("auto", "none", "ngram", "model", "dflash", "dflash+ngram", "dflash2", "dflash2+ngram")
BLOCK_DRAFTERS = ("dflash", "dflash+ngram", "dflash2", "dflash2+ngram")  # read the target's hidden states
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 8, "model": 4}
# "auto": the drafter measured fastest for the target with `dflash2 bench` (README, Results); ngram elsewhere.
MEASURED_DEFAULT_DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "dflash2+ngram"}


def default_drafter(target_name: str) -> str:
    """What ``drafter="auto"`` means for a target (store name, alias or path)."""
    from dflash2.models.store import canonical_name

    return MEASURED_DEFAULT_DRAFTERS.get(canonical_name(target_name) or target_name, "ngram")


def build_drafter(name: str, engine, *, draft_model: str | None = None, num_draft_tokens: int | None = None,
                  num_candidates: int = 1, dtype: str = "bf16", weights: str = "bf16", pull: bool = True) -> Drafter:
    """Build the named drafter for ``engine``'s target. Refuses a draft model whose tokenizer differs."""
    if name == "auto":
        name = default_drafter(engine.name)
    k = num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS.get(name, 4)
    if name == "ngram":
        from dflash2.drafters.ngram import NgramDrafter

        return NgramDrafter(k, stop_ids=engine.tokenizer.eos_token_ids, num_candidates=num_candidates)
    if name == "model":
        from dflash2.drafters.model import ModelDrafter
        from dflash2.models.loading import load_transformer
        from dflash2.models.store import DEFAULT_DRAFT, DEFAULT_TARGET, canonical_name, resolve_model
        from dflash2.models.tokenizer import Tokenizer

        default = DEFAULT_DRAFT if canonical_name(engine.name) == DEFAULT_TARGET else None  # same tokenizer
        ref = draft_model or default
        if ref is None:
            raise ValueError(f"no default draft model for {engine.name!r}; pass draft_model / --draft-model")
        draft_dir = resolve_model(ref, dtype, pull=pull)
        if Tokenizer(draft_dir).fingerprint() != engine.tokenizer.fingerprint():
            raise ValueError(f"draft model {ref!r} has a different tokenizer from the target; it cannot draft for it")
        model = load_transformer(draft_dir, dtype, engine.target.device, weights=weights)
        return ModelDrafter(model, k, target_vocab_size=engine.target.config.vocab_size)
    if name in BLOCK_DRAFTERS:
        from dflash2.drafters.dflash import load_dflash_drafter
        from dflash2.drafters.hybrid import HybridDrafter

        kind = name.partition("+")[0]
        directory = draft_model or shipped_dflash_drafter(engine.name, kind)
        # num_candidates W > 1: a tree of k * W nodes through the block's top candidates
        block = load_dflash_drafter(directory, engine.target, num_draft_tokens, num_paths=num_candidates)
        if not name.endswith("+ngram"):
            return block
        # num_draft_tokens sets the block's drafts; a prompt-lookup match may run as long as the n-gram drafter's
        lookup = max(block.num_draft_tokens, DEFAULT_NUM_DRAFT_TOKENS["ngram"])
        return HybridDrafter(block, lookup, stop_ids=engine.tokenizer.eos_token_ids)
    raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_NAMES)}")


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


__all__ = ["BLOCK_DRAFTERS", "DRAFTER_NAMES", "Draft", "Drafter", "TRAINED_DIR", "build_drafter", "default_drafter",
           "shipped_dflash_drafter"]
