"""Tokenizer and chat template of a model directory (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Sequence

ChatMessages = Sequence[dict[str, str]]


# tokenizer_config.json classes whose transformers tokenizer is tokenizer.json run as it is (no pipeline of its own,
# no BOS / prefix-space switches): for these the ``tokenizers`` library loads the same tokenizer without importing
# transformers' model registry (~1 s of CPU per process). tests/unit/models/test_tokenizer_fast_path.py compares the
# two on every model of the store it finds. Everything else (Gemma's BOS, GPT-2's prefix space, ...) loads through
# AutoTokenizer.
_TOKENIZERS_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast", "TokenizersBackend",
                                 "PreTrainedTokenizerFast"})
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Thin wrapper over the fast tokenizer: encode / decode, chat template, stop ids."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self._fingerprint: str | None = None
        self._hf = None
        fast = _FastTokenizer.load(model_dir)
        self._tok = fast if fast is not None else self.hf
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self._tok.eos_token_id))
        self.vocab_size = len(self._tok)

    @property
    def fast_path(self) -> bool:
        """Loaded with the ``tokenizers`` library alone (not through transformers' AutoTokenizer)."""
        return isinstance(self._tok, _FastTokenizer)

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
        """The transformers tokenizer (for libraries that read its vocabulary, e.g. a grammar engine); loaded at the
        first use where the fast path loaded the tokenizer."""
        if self._hf is None:
            from transformers import AutoTokenizer  # heavy import, kept out of `import dflash2`

            self._hf = AutoTokenizer.from_pretrained(str(self.model_dir))
            self._hf.model_max_length = 1 << 62  # the engine checks the context itself; no warning on long prompts
        return self._hf

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


class _FastTokenizer:
    """The part of a transformers fast tokenizer the engine uses, over the ``tokenizers`` library: tokenizer.json
    encodes and decodes exactly as transformers runs it for the classes of :data:`_TOKENIZERS_CLASSES`, and the chat
    template renders through transformers' own renderer (imported at the first chat, not at load)."""

    def __init__(self, tokenizer, special: dict[str, str], chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.special_tokens_map = special
        self.chat_template = chat_template
        self.bos_token_id = self._id(special.get("bos_token"))
        self.eos_token_id = self._id(special.get("eos_token"))

    @classmethod
    def load(cls, model_dir: Path) -> "_FastTokenizer | None":
        """The tokenizer of ``model_dir`` where it qualifies (tokenizer.json, a class of :data:`_TOKENIZERS_CLASSES`,
        no clean-up of spaces on decode, one chat template or none), else None."""
        path, config_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        if not (path.is_file() and config_path.is_file()):
            return None
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") not in _TOKENIZERS_CLASSES or config.get("clean_up_tokenization_spaces"):
            return None
        if config.get("add_bos_token") or config.get("add_eos_token") or config.get("add_prefix_space"):
            return None  # switches transformers applies over tokenizer.json's own pipeline
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if template is not None and not isinstance(template, str):
            return None  # named templates: transformers picks one
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                special[key] = str(value)
        import tokenizers

        return cls(tokenizers.Tokenizer.from_file(str(path)), special, template)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, tools: list[dict] | None, add_generation_prompt: bool,
                            tokenize: bool) -> str:
        """What transformers' ``apply_chat_template(..., tokenize=False)`` returns. Rendered here, in the sandbox,
        options, filters and globals transformers renders in (importing transformers costs ~1 s of CPU: it scans its
        model folders), for messages and tools of plain JSON data; anything else (reasoning fields, which
        transformers copies under other names; other objects; a template with ``{% generation %}``) goes to
        transformers' own renderer."""
        assert not tokenize
        template = _compiled_template(self.chat_template)
        data = _plain((messages, tools))
        if template is None or data is None or any(set(m) & _REASONING_FIELDS for m in data[0]):
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                                chat_template=self.chat_template,
                                                add_generation_prompt=add_generation_prompt,
                                                **self.special_tokens_map)
            return rendered[0]
        return template.render(messages=data[0], tools=data[1], documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens_map)


_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _plain(value):
    """A copy of ``value`` made of JSON types only (messages and tools as the server and the CLI give them), or None
    where it holds anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (list, tuple):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if type(value) is dict and all(type(k) is str for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return None if any(items[k] is None and value[k] is not None for k in value) else items
    return None


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """``source`` compiled as transformers compiles a chat template (its immutable sandbox, trim_blocks and
    lstrip_blocks, loop controls, a tojson that keeps non-ASCII text and does not escape HTML, raise_exception,
    strftime_now, a ``dict`` without attribute access, a ``namespace`` refusing underscore names); None for a
    template with transformers' ``{% generation %}`` tag."""
    if _GENERATION_TAG.search(source):
        return None
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)
