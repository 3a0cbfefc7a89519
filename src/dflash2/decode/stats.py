"""What one generation measured. Filled by the decoding loops, read by the CLI, the API and the benchmark."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # decode-phase target passes (prefill excluded), each commits >= 1 token
    committed_tokens: int = 0  # tokens those passes committed (a final EOS included, drafts past max_new_tokens too)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time after prefill
    draft_seconds: float = 0.0  # time spent in the drafter (speculative decoding only)
    verify_seconds: float = 0.0  # time spent in target verification passes
    drafted_by_position: list[int] = field(default_factory=list)  # [k] drafts proposed at position i
    accepted_by_position: list[int] = field(default_factory=list)  # [k] drafts accepted at position i

    def record_draft(self, num_drafted: int, num_accepted: int) -> None:
        """One verification: ``num_drafted`` drafts proposed, the first ``num_accepted`` kept."""
        grow = num_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted

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
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("seconds", "tokens_per_s", "decode_tokens_per_s", "tau", "acceptance_by_position"):
            out[name] = getattr(self, name)
        return out
