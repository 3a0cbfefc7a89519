"""A drafter spec, ``name[:[L+]k[xW]]``: which drafter, its draft length k, its tree width W and (pard) its lead L,
parsed in one place for the command line (``--drafter``, ``bench --drafters``), the Python API
(``dflash2.load(drafter=...)``) and the server; and the one table of default draft lengths.

    DrafterSpec.parse("dflash2:2x3")  # DrafterSpec(name='dflash2', num_draft_tokens=2, num_candidates=3)
    DrafterSpec.parse("ngram")        # k and W unset: the defaults below, a chain
    DrafterSpec.parse("pard:1+4x3")   # pard: one lead token, then a pass knowing it (a tree of 1 + 4 x 3 nodes)

Imports nothing from dflash2 at module level, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DRAFTER_NAMES = ("auto", "none", "ngram", "model", "dflash", "dflash+ngram", "dflash2", "dflash2+ngram", "pard",
                 "pard+ngram")
BLOCK_DRAFTERS = ("dflash", "dflash+ngram", "dflash2", "dflash2+ngram")  # read the target's hidden states
LEAD_DRAFTERS = ("auto", "pard", "pard+ngram")  # take a lead L (L+k): L drafts one per pass, then k in one pass

# Default draft length k per drafter, the one table. None: the length recorded in the drafter directory's
# config.json as ``default_num_draft_tokens`` (the one measured best for that drafter), else its block_size - 1
# (drafters/dflash.py, load_dflash_drafter). A ``+ngram`` hybrid drafts the block drafter's k from the block and
# lets a prompt-lookup match run up to max(that k, the ngram default).
DEFAULT_NUM_DRAFT_TOKENS: dict[str, int | None] = {
    "ngram": 8,
    "model": 4,
    "dflash": None,
    "dflash+ngram": None,
    "dflash2": None,
    "dflash2+ngram": None,
    "pard": None,  # pard_config.json's num_draft_tokens (drafters/pard.py)
    "pard+ngram": None,  # the same; a prompt-lookup match may run up to max(k, the ngram default)
}

# "auto": the drafter measured fastest for the target (docs/pard.md, "auto"); ngram elsewhere. One request at a
# time (generate, the Python API, bench): `dflash2 bench` on HumanEval, GSM8K, MT-bench and Spec-Bench. The
# server (continuous batching, `serving=True`): scripts/bench_serve.py with 8 concurrent clients, where a drafter
# with its own model pass per request (pard) costs more than a batched plain step saves.
MEASURED_DEFAULT_DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "pard+ngram"}
MEASURED_SERVING_DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "dflash2+ngram"}
# The server where the target verifies on AMX tiles (a step of 16 rows costs about one of 8): pard's shared pass pays
# there, pard+ngram 1.13-1.26x over plain against dflash2+ngram's 1.07-1.09x (docs/serving.md, Intel Xeon (AMX),
# 2026-12-05); with the GGUF's blocks on the gguf kernel's AMX build too, over HTTP (scripts/bench_http.py, one run,
# 16 requests): 1.55x / 1.91x plain at 4 / 8 clients against 1.38x / 1.81x (2026-12-06); elsewhere (AMD
# EPYC Zen 3 AVX2 2026-12-03, Zen 4 AVX-512 BF16 2026-12-04) pard stayed below plain at 8 clients.
MEASURED_TILE_SERVING_DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "pard+ngram"}
# Where the target's linear layers run on AMX tiles over the whole K (bf16, int8), a forward of up to 16 rows costs
# about one of 4 (a tile product costs the same for 1-16 rows), so one request verifies a best-first tree of k * W
# drafts from the same single pard pass for nearly the price of a chain: pard+ngram:4x3 (13 rows) measured fastest
# there (docs/pard.md, Intel Xeon (AMX), 2026-12-04; 4x4 = 17 rows crosses into a second block of rows and loses).
# Elsewhere more rows cost more (AVX-512 BF16: 7 rows 1.45x 4 rows; the gguf AMX build: no gain), and the chain stays.
MEASURED_TILE_DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "pard+ngram:4x3"}


def default_drafter(target_name: str, serving: bool = False, tile_verification: bool = False) -> str:
    """What ``drafter="auto"`` means for a target (store name, alias or path), for one request at a time or for
    the batch server (``serving``): a spec, ``name[:[L+]k[xW]]``. ``tile_verification``: for one request, the
    target's linear layers run on AMX tiles over the whole K (:func:`dflash2.kernels.packed_linear.
    tile_verification`): it then verifies a tree; for the server, on AMX tiles in any form, the GGUF kernel's AMX
    build too (:func:`~dflash2.kernels.packed_linear.amx_verification`): it then drafts with pard (chains: its
    pard passes are shared by its requests)."""
    from dflash2.models.store import canonical_name

    name = canonical_name(target_name) or target_name
    if serving:
        table = MEASURED_TILE_SERVING_DRAFTERS if tile_verification else MEASURED_SERVING_DRAFTERS
    else:
        table = MEASURED_TILE_DRAFTERS if tile_verification else MEASURED_DEFAULT_DRAFTERS
    return table.get(name, "ngram")


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

    def resolved(self, target_name: str, serving: bool = False, tile_verification: bool = False) -> "DrafterSpec":
        """``auto`` replaced by the drafter it means for ``target_name`` (other names unchanged); ``serving`` and
        ``tile_verification`` as in :func:`default_drafter`. A shape given with ``auto`` (``auto:3``) replaces the
        default's whole shape."""
        if self.name != "auto":
            return self
        default = DrafterSpec.parse(default_drafter(target_name, serving, tile_verification))
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
