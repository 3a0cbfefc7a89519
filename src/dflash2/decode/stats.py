"""What one generation measured. Filled by the decoding loops, read by the CLI, the API and the benchmark."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed again)
    new_tokens: int = 0
    target_forwards: int = 0  # decode-phase target passes (prefill excluded), each commits >= 1 token
    committed_tokens: int = 0  # tokens those passes committed (a final EOS included, drafts past max_new_tokens too)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time after prefill
    draft_seconds: float = 0.0  # time spent in the drafter (speculative decoding only)
    verify_seconds: float = 0.0  # time spent in target verification passes
    drafted_by_position: list[int] = field(default_factory=list)  # [k] drafts proposed at position i
    accepted_by_position: list[int] = field(default_factory=list)  # [k] drafts accepted at position i
    pipeline: str = "sync"  # "sync" (draft, then verify) or "overlap" (the drafter works while the target verifies)
    predrafts: int = 0  # overlap: blocks drafted ahead, while the target verified the previous block
    predraft_hits: int = 0  # overlap: pre-drafted blocks used as the next draft (their assumed outcome came true)

    def record_draft(self, num_drafted: int, num_accepted: int) -> None:
        """One verification: ``num_drafted`` drafts proposed, the first ``num_accepted`` kept."""
        self._positions(num_drafted)
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted

    def add_decoding(self, other: DecodeStats) -> None:
        """Add another generation's decoding counts (new tokens, target passes, committed tokens, drafts by
        position) to these totals."""
        self.new_tokens += other.new_tokens
        self.target_forwards += other.target_forwards
        self.committed_tokens += other.committed_tokens
        self._positions(len(other.drafted_by_position))
        for position, (drafted, accepted) in enumerate(zip(other.drafted_by_position, other.accepted_by_position)):
            self.drafted_by_position[position] += drafted
            self.accepted_by_position[position] += accepted

    def _positions(self, count: int) -> None:
        """Count drafts at positions up to ``count`` - 1."""
        grow = count - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole wall time, prefill included."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens committed by decode passes (the first token comes from prefill) over decode time."""
        return max(self.new_tokens - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens committed per decode-phase target forward, recovered/bonus included (plain decoding: 1.0)."""
        return self.committed_tokens / self.target_forwards if self.target_forwards else 1.0

    @property
    def predraft_hit_rate(self) -> float:
        return self.predraft_hits / self.predrafts if self.predrafts else 0.0

    @property
    def target_idle_fraction(self) -> float:
        """Share of decode wall time the target was not verifying (the target's bubble)."""
        return _idle(self.verify_seconds, self.decode_seconds)

    @property
    def drafter_idle_fraction(self) -> float:
        """Share of decode wall time the drafter was not drafting (the drafter's bubble)."""
        return _idle(self.draft_seconds, self.decode_seconds)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("seconds", "tokens_per_s", "decode_tokens_per_s", "tau", "acceptance_by_position",
                     "predraft_hit_rate", "target_idle_fraction", "drafter_idle_fraction"):
            out[name] = getattr(self, name)
        return out


def _idle(busy_seconds: float, wall_seconds: float) -> float:
    return min(max(1.0 - busy_seconds / wall_seconds, 0.0), 1.0) if wall_seconds > 0 else 0.0
