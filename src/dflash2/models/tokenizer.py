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
        self.model_dir = model_dir
        self._fingerprint: str | None = None
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._tok.model_max_length = 1 << 62  # the engine checks the context itself; no warning on long prompts
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self._tok.eos_token_id))
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no chat template) with the special tokens the tokenizer itself puts before a text: Gemma's
        BOS (as llama.cpp adds it; without it Gemma 3 degenerates at once); none for Qwen2.5 and SmolLM2. A text that
        already begins with the BOS text keeps one BOS."""
        ids = self._tok.encode(text, add_special_tokens=True)
        bos = self._tok.bos_token_id
        return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a ``tools`` list (and tool calls / results) itself (Qwen2.5's does)."""
        return "tools" in (getattr(self._tok, "chat_template", None) or "")

    @property
    def hf(self):
        """The transformers tokenizer (for libraries that read its vocabulary, e.g. a grammar engine)."""
        return self._tok

    def apply_chat_template(self, messages: ChatMessages, tools: list[dict] | None = None) -> list[int]:
        """Render chat messages (and ``tools`` for a template that renders them) with the model's template, ending
        with the assistant's generation prompt."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; pass raw=True to use the prompt as is")
        text = self._tok.apply_chat_template(list(messages), tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
        return self.encode(text)

    def fingerprint(self) -> str:
        """Hash of the vocabulary: two models can share drafts only if their fingerprints are equal."""
        if self._fingerprint is None:
            vocab = sorted(self._tok.get_vocab().items(), key=lambda item: item[1])
            self._fingerprint = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
        return self._fingerprint

    def same_vocabulary(self, model_dir: str | Path) -> bool:
        """Whether the tokenizer of ``model_dir`` has this vocabulary (a drafter's tokens are the target's). Where
        its tokenizer.json and added tokens are this one's files, at once (Qwen2.5-Coder's 0.5B and 1.5B share
        them); else by loading it and comparing fingerprints (~2 s)."""
        mine = _vocabulary_files(self.model_dir)
        if mine is not None and mine == _vocabulary_files(Path(model_dir)):
            return True
        return Tokenizer(model_dir).fingerprint() == self.fingerprint()


def _vocabulary_files(model_dir: Path) -> tuple[bytes, object] | None:
    """What a fast tokenizer's vocabulary comes from: tokenizer.json's bytes and tokenizer_config.json's added
    tokens (None where there is no tokenizer.json: then only loading both can tell)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    config = model_dir / "tokenizer_config.json"
    added = json.loads(config.read_text()).get("added_tokens_decoder") if config.is_file() else None
    return path.read_bytes(), added


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return ids
