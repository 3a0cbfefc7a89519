"""Tokenizer and chat template of a model directory (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

ChatMessages = Sequence[dict[str, str]]


class Tokenizer:
    """Thin wrapper over the fast tokenizer: encode / decode, chat template, stop ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, kept out of `import dflash2`

        model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._tok.model_max_length = 1 << 62  # the engine checks the context itself; no warning on long prompts
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self._tok.eos_token_id))
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: ChatMessages) -> list[int]:
        """Render chat messages with the model's template, ending with the assistant's generation prompt."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; pass raw=True to use the prompt as is")
        text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def fingerprint(self) -> str:
        """Hash of the vocabulary: two models can share drafts only if their fingerprints are equal."""
        vocab = sorted(self._tok.get_vocab().items(), key=lambda item: item[1])
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return ids
