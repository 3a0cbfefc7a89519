"""What every peer runner returns, and the settings all of them share with dflash2's own methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence


class PeerError(RuntimeError):
    """A peer cannot run here (missing package, binary or model file): reported in one line, never skipped."""


@dataclass(frozen=True)
class PeerSetup:
    """The same target, drafter, dtype, threads and stop tokens as the dflash2 run the peers join."""

    target_dir: Path  # HF-layout directory (safetensors) of the target, as dflash2 loads it
    target_gguf: Path  # the store's GGUF file (4-bit) for llama.cpp
    draft_dir: Path | None  # the small draft model (HF layout and GGUF); None when the target has no pairing
    draft_gguf: Path | None
    dtype: str  # "bf16" | "fp16" | "fp32", transformers peers only
    threads: int
    eos_ids: frozenset[int]
    n_ctx: int = 4096  # llama.cpp context (prompt + new tokens must fit)
    num_draft_tokens: int | None = None  # assisted / speculative draft length; None = the tool's default
    dflash_drafter: Path | None = None  # a DFlash drafter in the layout llama.cpp loads (llamacpp-dflash)


def require_draft(setup: PeerSetup, peer: str) -> tuple[Path, Path]:
    if setup.draft_dir is None or setup.draft_gguf is None:
        raise PeerError(f"peer {peer} needs a draft model: pass --draft-model")
    return setup.draft_dir, setup.draft_gguf


@dataclass
class PeerResult:
    token_ids: list[int]  # new tokens, cut before the first EOS (as dflash2's results are)
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float  # wall time after prefill
    target_forwards: int | None = None  # target passes over the whole generation (prefill included), if known
    finish_reason: str = "length"  # "eos" | "length"
    drafted: int | None = None  # draft tokens proposed / accepted in total, where the peer reports them
    accepted: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        seconds = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which prefill produces) over decode time, as dflash2 measures it."""
        return max(self.new_tokens - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tau(self) -> float | None:
        """New tokens per target forward (plain decoding: 1.0); None where the peer does not expose its passes."""
        return self.new_tokens / self.target_forwards if self.target_forwards else None


class Peer(Protocol):
    name: str
    plain_sibling: str | None  # the peer's own plain decoding (e.g. "transformers" for "transformers-assisted")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult: ...

    def close(self) -> None: ...


def cut_at_eos(ids: Sequence[int], eos_ids: frozenset[int]) -> tuple[list[int], str]:
    """New ids before the first EOS, and the finish reason."""
    for index, token in enumerate(ids):
        if token in eos_ids:
            return list(ids[:index]), "eos"
    return list(ids), "length"
