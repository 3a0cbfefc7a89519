"""What every decoding loop does with committed tokens: one finish rule (EOS, stop strings, token limit),
incremental text with stop strings held back, and the result.

The single-request loop (``Engine.stream``, sync or overlapped) and the batch engine both push each target pass's
committed ids into an :class:`OutputTracker` and send the chunks it returns; so EOS, stop strings and
``max_new_tokens`` end a request at the same token whichever loop runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dflash2.decode.stats import DecodeStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (the stop EOS excluded)
    finish_reason: str  # "eos" | "stop" (a stop string) | "length" (max_new_tokens or context limit) | "timeout"
    # (the server's per-request deadline)
    stats: DecodeStats
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty while a multi-byte character is incomplete)
    token_ids: list[int]  # ids committed by this target pass


class OutputTracker:
    """The generated ids and text of one request, and why it finished (None while it runs)."""

    def __init__(self, tokenizer, max_new_tokens: int, stop: Sequence[str] = ()) -> None:
        self.eos_ids = tokenizer.eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.text = TextStream(tokenizer, stop)
        self.generated: list[int] = []
        self.finish_reason: str | None = None  # "eos" | "stop" | "length" once a rule has ended the request

    def push(self, committed: list[int]) -> StreamChunk | None:
        """Take one pass's committed ids: cut at EOS and at the token limit, detokenise, check stop strings.
        Returns the chunk to send (None when there is nothing new)."""
        ids, hit_eos = cut_at_eos(committed, self.eos_ids)
        ids = ids[: self.max_new_tokens - len(self.generated)]
        self.generated.extend(ids)
        delta, hit_stop = self.text.push(self.generated)
        if hit_eos or hit_stop or len(self.generated) >= self.max_new_tokens:
            self.finish_reason = "stop" if hit_stop else ("eos" if hit_eos else "length")
        return StreamChunk(text=delta, token_ids=ids) if delta or ids else None

    def finish(self, reason: str, stats: DecodeStats, prompt_ids: list[int]
               ) -> tuple[StreamChunk | None, GenerationResult]:
        """The held-back text as a last chunk (None when there is none) and the result."""
        stats.new_tokens = len(self.generated)
        tail = self.text.flush()
        last = StreamChunk(text=tail, token_ids=[]) if tail else None
        return last, GenerationResult(self.text.text, self.generated, reason, stats, list(prompt_ids))


def cut_at_eos(ids: list[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    for index, token in enumerate(ids):
        if token in eos_ids:
            return ids[:index], True
    return ids, False


class TextStream:
    """Incremental detokenisation with stop strings: emits only text that is final."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # the final text (truncated before a stop string when one was hit)
        self.emitted = 0  # characters of ``text`` already yielded
        self.stopped = False

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """Re-decode all ids; return (new final text, whether a stop string was hit)."""
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text)), True
        self.text = text
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD: hold it back
        held = max((_overlap(text[:safe], s) for s in self.stop), default=0)  # could start a stop string
        return self._take(safe - held), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
