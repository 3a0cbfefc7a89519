"""A drafter spec, ``name[:[L+]k[xW]]``: which drafter, its draft length k, its tree width W and (pard) its lead L,
parsed in one place for the command line (``--drafter``, ``bench --drafters``), the Python API
(``dflash2.load(drafter=...)``) and the server; and the one table of default draft lengths.

    DrafterSpec.parse("dflash2:2x3")  # DrafterSpec(name='dflash2', num_draft_tokens=2, num_candidates=3)
    DrafterSpec.parse("ngram")        # k and W unset: the defaults below, a chain
    DrafterSpec.parse("pard:1+4x3")   # pard: one lead token, then a pass knowing it (a tree of 1 + 4 x 3 nodes)

Imports nothing from dflash2 at module level but the platform profile (:mod:`dflash2.platform`, below every layer),
so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dflash2.platform import DraftHardware

if TYPE_CHECKING:
    from dflash2.models.decoder import Transformer
    from dflash2.models.tokenizer import Tokenizer

@dataclass(frozen=True)
class DrafterKind:
    """One drafter of the table below: how it is built and what it takes."""

    build: str  # "module:function" making it from (DraftTarget, DraftOptions) (below), imported when built
    num_draft_tokens: int | None  # its default draft length k; None: the drafter directory's own
    reads_hidden: bool = False  # reads the target's hidden states (a block drafter)
    lead: bool = False  # takes a lead L (L+k): L drafts one per pass, then k in one pass
    with_ngram: bool = False  # also offered as "<name>+ngram": a long prompt-lookup match first (drafters/hybrid.py)


# The drafters, the one table: a new drafter is its module and one line here. Default k None: the length recorded in
# the drafter directory (a block drafter's config.json ``default_num_draft_tokens``, else its block_size - 1; pard's
# pard_config.json ``num_draft_tokens``). A ``+ngram`` hybrid drafts the drafter's k from it and lets a prompt-lookup
# match run up to max(that k, the ngram default).
DRAFTERS: dict[str, DrafterKind] = {
    "ngram": DrafterKind("dflash2.drafters.ngram:build_ngram_drafter", 8),
    "model": DrafterKind("dflash2.drafters.model:build_model_drafter", 4),
    "dflash": DrafterKind("dflash2.drafters.dflash:build_block_drafter", None, reads_hidden=True, with_ngram=True),
    "dflash2": DrafterKind("dflash2.drafters.dflash:build_block_drafter", None, reads_hidden=True, with_ngram=True),
    "pard": DrafterKind("dflash2.drafters.pard:build_pard", None, lead=True, with_ngram=True),
}
HYBRID_SUFFIX = "+ngram"


def drafter_kind(name: str) -> DrafterKind:
    """The table's entry for ``name`` (a ``+ngram`` hybrid: its drafter's)."""
    return DRAFTERS[name.removesuffix(HYBRID_SUFFIX)]


_TABLE_NAMES = tuple(n for name, kind in DRAFTERS.items() for n in (name, *([name + HYBRID_SUFFIX] * kind.with_ngram)))
DRAFTER_NAMES = ("auto", "none", *_TABLE_NAMES)
BLOCK_DRAFTERS = tuple(name for name in _TABLE_NAMES if drafter_kind(name).reads_hidden)
LEAD_DRAFTERS = ("auto", *(name for name in _TABLE_NAMES if drafter_kind(name).lead))
DEFAULT_NUM_DRAFT_TOKENS: dict[str, int | None] = {name: drafter_kind(name).num_draft_tokens for name in _TABLE_NAMES}


@dataclass(frozen=True)
class AutoDrafter:
    """One row of the table of what ``drafter="auto"`` means: for ``target``, one request at a time or in the batch
    server (``serving``), where the target verifies on ``verification`` (:data:`VERIFICATION`), the drafter
    ``spec`` (``name[:[L+]k[xW]]``: drafter and draft length), chosen by the measurement ``measured``."""

    target: str  # store name (canonical)
    serving: bool
    verification: str  # a key of VERIFICATION
    spec: str
    measured: str  # date, CPU, command, commit, where the numbers are


# What a row's ``verification`` asks of the target's kernels (:class:`dflash2.platform.DraftHardware`).
VERIFICATION: dict[str, Callable[[DraftHardware], bool]] = {
    # linear layers on AMX tiles over the whole K (bf16, or int8 widened to bf16): 1-16 rows cost about one
    # (or, with DFLASH2_VERIFY_CALIBRATION=on, where the target's measured 13 rows cost at most 1.2x its 4 rows)
    "flat": lambda hardware: hardware.flat_verification,
    # on AMX tiles in any form, the gguf kernel's AMX build too (its per-block steps grow with the rows)
    "amx": lambda hardware: hardware.amx_verification,
    "any": lambda hardware: True,
}

# "auto", the one table: the first row for the target, the mode and the target's verification wins; targets not
# named here draft with ngram. Elsewhere than AMX tiles more verified rows cost more (AVX2 on the AMD EPYC Zen 3: 7
# rows 1.45x 4 rows), so one request drafts a narrower tree there, trimmed to the nodes that pay for their rows by
# the drafter's confidence (decode/draft_length.py).
AUTO_DRAFTERS: tuple[AutoDrafter, ...] = (
    AutoDrafter("qwen2.5-coder-1.5b-instruct", False, "flat", "pard+ngram:4x3",
                "2026-12-04, Intel Xeon (AMX, model 207), 2 cores, commit 364940b: `dflash2 bench --suite "
                "gsm8k,mt_bench --limit 4 --max-new-tokens 128 --drafters auto,pard+ngram:3x2,pard+ngram:4x3,...`, "
                "two runs: 4x3 (13 rows) 2.62x / 2.01x plain against the chain's 2.23x / 1.66x; int8 2.28x / 1.74x "
                "against 1.92x / 1.44x; 4x4 (17 rows, a second block of rows) loses (docs/pard.md)"),
    AutoDrafter("qwen2.5-coder-1.5b-instruct", False, "any", "pard+ngram:4x2",
                "2026-12-07, AMD EPYC Zen 4, 2 cores, commit da66b08: `dflash2 bench --suite "
                "humaneval,gsm8k,mt_bench --limit 4 --max-new-tokens 128 --drafters auto,pard+ngram:4x2,...`, "
                "drafts trimmed by confidence: bf16 2.78x plain overall against the trimmed chain's 2.70x "
                "(MT-bench 1.82x against 1.65x) and the fixed chain's 2.62x in the run after; gguf 1.86x against "
                "1.84x; interleaved in bf16 GSM8K 2.08x against 1.85x. pard+ngram over dflash2+ngram: 2026-12-03, "
                "AMD EPYC Zen 3 (AVX2), commit 32ed2e9, decode 2.18x plain against 1.97x (docs/pard.md)"),
    AutoDrafter("qwen2.5-coder-1.5b-instruct", True, "amx", "pard+ngram",
                "2026-12-05, Intel Xeon (AMX, model 207), 2 cores, commit 35c4558 (adopted in b640fc5): "
                "`dflash2 bench serve batch --model qwen2.5-coder-1.5b-instruct --dtype bf16 --drafter D --streams 8 "
                "--modes plain,adaptive --requests 24 --max-tokens 128 --suite humaneval,gsm8k,mt_bench --threads 2`"
                ", 96 new tokens: 1.13-1.24x plain against dflash2+ngram's 1.07-1.09x; on the gguf AMX build over HTTP (2026-12-06, commit d640876, `dflash2 bench serve http "
                "--weights gguf --clients 4,8 --requests 16 --max-tokens 128`) 1.55x / 1.91x plain at 4 / 8 clients "
                "against 1.38x / 1.81x (docs/serving.md)"),
    AutoDrafter("qwen2.5-coder-1.5b-instruct", True, "any", "dflash2+ngram",
                "2026-12-03, AMD EPYC Zen 3 (AVX2), 2 cores, commit 32ed2e9: `dflash2 bench serve batch --model "
                "qwen2.5-coder-1.5b-instruct --dtype bf16 --drafter D --streams 8 --requests 8 --max-tokens 128 "
                "--suite humaneval,gsm8k,mt_bench`: 24.2 tokens/s against pard+ngram's 17.5 (plain 23.0); pard's own "
                "pass per request stayed below plain at 8 clients on AVX2 and AVX-512 BF16 (docs/pard.md)"),
)


def default_drafter(target_name: str, serving: bool = False, hardware: DraftHardware = DraftHardware()) -> str:
    """What ``drafter="auto"`` means for a target (store name, alias or path), for one request at a time or for
    the batch server (``serving``), where the target runs as ``hardware`` says (its verification on AMX tiles or
    not; :func:`dflash2.kernels.profile.draft_hardware`): the spec of the first matching row of
    :data:`AUTO_DRAFTERS`, else ``ngram``."""
    from dflash2.models.store import canonical_name

    name = canonical_name(target_name) or target_name
    for row in AUTO_DRAFTERS:
        if row.target == name and row.serving == serving and VERIFICATION[row.verification](hardware):
            return row.spec
    return "ngram"


def default_num_draft_tokens(name: str) -> int | None:
    """The default draft length of drafter ``name`` (None: the drafter directory's own, see the table)."""
    if name not in DEFAULT_NUM_DRAFT_TOKENS:
        raise ValueError(f"drafter {name!r} has no default draft length; one of {', '.join(DEFAULT_NUM_DRAFT_TOKENS)}")
    return DEFAULT_NUM_DRAFT_TOKENS[name]


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter and its shape; unset fields take the defaults (k: the table above, W: 1, a chain)."""

    name: str  # one of DRAFTER_NAMES
    num_draft_tokens: int | None = None  # k: drafts per step (a tree's depth); None = the drafter's default
    num_candidates: int | None = None  # W: tree width (ngram: W continuations; block drafters: k * W nodes)
    lead_tokens: int | None = None  # L (pard only): drafts made one per pass before the k-token pass; None = 0

    @property
    def lead(self) -> int:
        """L, 0 when unset."""
        return self.lead_tokens or 0

    def __post_init__(self) -> None:
        if self.name not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter {self.name!r}; choose one of {', '.join(DRAFTER_NAMES)}")
        for field, value in (("num_draft_tokens", self.num_draft_tokens), ("num_candidates", self.num_candidates),
                             ("lead_tokens", self.lead_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.name == "none" and (self.num_draft_tokens is not None or self.num_candidates is not None):
            raise ValueError("drafter 'none' (plain decoding) drafts nothing: it takes no k or W")
        if self.lead_tokens is not None and self.name not in LEAD_DRAFTERS:
            raise ValueError(f"only {', '.join(LEAD_DRAFTERS)} draft lead tokens (L+k); {self.name!r} does not")

    @classmethod
    def parse(cls, text: "str | DrafterSpec | None") -> "DrafterSpec":
        """``name``, ``name:k``, ``name:kxW`` or ``name:L+k[xW]`` (positive integers) -> a spec; None -> ``none``.

        A spec passes through unchanged. Raises ValueError naming what is wrong.
        """
        if isinstance(text, DrafterSpec):
            return text
        if text is None:
            return cls("none")
        name, colon, shape = text.strip().partition(":")
        if name not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter {name!r} in {text!r}; choose one of {', '.join(DRAFTER_NAMES)}")
        if not colon:
            return cls(name)
        lead, plus, shape = shape.rpartition("+")
        k, times, width = shape.partition("x")
        if not _positive(k) or (times and not _positive(width)) or (plus and not _positive(lead)):
            raise ValueError(f"the draft shape in {text!r} must be k or kxW (pard: L+k or L+kxW) with positive "
                             f"integers (e.g. {name}:3, {name}:3x2 or pard:1+4x3)")
        return cls(name, int(k), int(width) if times else None, int(lead) if plus else None)

    def merge(self, num_draft_tokens: int | None = None, num_candidates: int | None = None) -> "DrafterSpec":
        """This spec with k and W also given separately (``-k``, ``--num-candidates``, keyword arguments): a value
        the spec leaves unset is taken; one it sets must be the same (else ValueError: which one wins is not
        guessed). ``none`` ignores them (plain decoding drafts nothing)."""
        if not self.drafts:
            return self
        for what, mine, given in (("k", self.num_draft_tokens, num_draft_tokens),
                                  ("W", self.num_candidates, num_candidates)):
            if mine is not None and given is not None and mine != given:
                flag = "num_draft_tokens (-k)" if what == "k" else "num_candidates (--num-candidates)"
                raise ValueError(f"drafter {str(self)!r} sets {what}={mine} but {flag} is {given}; give it once")
        return replace(self, num_draft_tokens=self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
                       num_candidates=self.num_candidates if num_candidates is None else num_candidates)

    def resolved(self, target_name: str, serving: bool = False,
                 hardware: DraftHardware = DraftHardware()) -> "DrafterSpec":
        """``auto`` replaced by the drafter it means for ``target_name`` (other names unchanged); ``serving`` and
        ``hardware`` as in :func:`default_drafter`. A shape given with ``auto`` (``auto:3``) replaces the default's
        whole shape."""
        if self.name != "auto":
            return self
        default = DrafterSpec.parse(default_drafter(target_name, serving, hardware))
        if self.num_draft_tokens is None and self.num_candidates is None:
            return default
        return replace(self, name=default.name)

    @property
    def drafts(self) -> bool:
        """False for ``none`` (plain decoding)."""
        return self.name != "none"

    @property
    def width(self) -> int:
        """W, 1 (a chain) when unset."""
        return self.num_candidates or 1

    def __str__(self) -> str:
        """``name[:[L+]k[xW]]`` as parsed (a W set without k reads ``name (W=3)``)."""
        lead = f"{self.lead_tokens}+" if self.lead_tokens is not None else ""
        text = self.name if self.num_draft_tokens is None else f"{self.name}:{lead}{self.num_draft_tokens}"
        if self.num_candidates is not None:
            text += f"x{self.num_candidates}" if self.num_draft_tokens is not None else f" (W={self.num_candidates})"
        if self.lead_tokens is not None and self.num_draft_tokens is None:
            text += f" (L={self.lead_tokens})"
        return text


def _positive(text: str) -> bool:
    return text.isascii() and text.isdigit() and int(text) > 0  # no sign, spaces or empty string


@dataclass(frozen=True)
class DraftTarget:
    """What building a drafter needs from the target (an :class:`~dflash2.decode.engine.Engine` has the same three
    attributes, so either may be passed to :func:`build_drafter`)."""

    target: Transformer  # the model the drafter drafts for (block drafters read its hidden states, embeddings, head)
    tokenizer: Tokenizer  # its EOS ids stop n-gram drafts; a draft model must share its fingerprint
    name: str = ""  # the target's store name, alias or path: picks "auto" and the shipped or paired drafter


@dataclass(frozen=True)
class DraftOptions:
    """What a drafter's builder (the table above) gets besides the target: :func:`build_drafter`'s
    arguments, resolved."""

    spec: DrafterSpec  # its name is the table's (no "auto", no "+ngram": the hybrid is built around the drafter)
    num_draft_tokens: int | None  # k: the spec's, else the table's default (None: the drafter directory's own)
    draft_model: str | None = None  # a drafter directory or store model; None: the drafter's default for the target
    dtype: str = "bf16"
    weights: str = "bf16"
    pull: bool = True  # fetch what the store lacks
    hardware: DraftHardware | None = None  # how the kernels here run the target (the defaults that depend on it)
