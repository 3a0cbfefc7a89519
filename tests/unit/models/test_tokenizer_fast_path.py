"""The tokenizer loaded with the ``tokenizers`` library alone (no AutoTokenizer: ~1 s less per process) gives what
AutoTokenizer gives on the store's models: encode (with and without special tokens), decode, the chat template with
and without tools, the special and eos tokens, the vocabulary. Gemma 3 (a BOS added by transformers) keeps
AutoTokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2 import platform
from dflash2.models.tokenizer import Tokenizer

pytestmark = pytest.mark.model

TEXTS = ("Write a Python function that checks whether a number is prime.", "  leading spaces\n\ttabs and\r\n",
         "héllo wörld 你好 🙂 <|im_end|> <|endoftext|>", "def f(x):\n    return x ** 2  # comment", "")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2? é"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


def _store_dir(name: str):
    path = platform.settings().home / "models" / name / "bf16"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{name} is not in the store")
    return path


@pytest.fixture(scope="module")
def smollm2_dir():
    from dflash2.models.store import resolve_model

    return resolve_model("smollm2-135m-instruct", "bf16")


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct",
                                        "qwen2.5-coder-0.5b-instruct"])
def pair(request, smollm2_dir):
    path = smollm2_dir if request.param == "smollm2-135m-instruct" else _store_dir(request.param)
    tok = Tokenizer(path)
    return tok, tok.hf


def test_these_models_take_the_fast_path(pair):
    tok, hf = pair
    assert tok.fast_path
    assert type(hf).__name__ != "_FastTokenizer"


def test_encode_and_decode_are_autotokenizers(pair):
    tok, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids
        assert tok.encode_prompt(text) == hf.encode(text, add_special_tokens=True)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    mixed = hf.encode("a <|im_end|> b", add_special_tokens=False) + sorted(hf.all_special_ids)
    assert tok.decode(mixed) == hf.decode(mixed, skip_special_tokens=True)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_chat_template_is_autotokenizers(pair, tools):
    tok, hf = pair
    assert tok.has_chat_template == bool(hf.chat_template)
    assert tok.renders_tools == ("tools" in hf.chat_template)
    text = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(MESSAGES, tools=tools) == hf.encode(text, add_special_tokens=False)


TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "{\"temp\": 21}"},
              {"role": "assistant", "content": "21 °C", "reasoning_content": "read the tool's answer"}]


def test_tool_turns_and_reasoning_fields_render_as_autotokenizer(pair):
    """Reasoning fields take transformers' renderer (it copies them under other names); tool calls render here."""
    tok, hf = pair
    for messages in (TOOL_TURNS[:3], TOOL_TURNS):
        text = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert tok._tok.apply_chat_template(messages, TOOLS, True, False) == text


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content | tojson }}"
    "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}{{ bos_token }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}{% for m in messages %}"
    "{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"])
def test_a_template_renders_as_transformers_renders_it(pair, template):
    tok, hf = pair
    fast = tok._tok
    saved = fast.chat_template
    try:
        fast.chat_template = template
        text = hf.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=False)
        assert fast.apply_chat_template(MESSAGES, None, True, False) == text
    finally:
        fast.chat_template = saved


def test_transformers_is_not_imported_for_a_chat(smollm2_dir):
    import subprocess
    import sys

    code = ("import sys; from dflash2.models.tokenizer import Tokenizer; "
            f"t = Tokenizer({str(smollm2_dir)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}]); "
            "t.decode(t.encode('hi')); print('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_special_tokens_and_vocabulary_are_autotokenizers(pair):
    tok, hf = pair
    fast = tok._tok
    assert fast.special_tokens_map == hf.special_tokens_map
    assert (fast.bos_token_id, fast.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.eos_token_ids >= {hf.eos_token_id}
    assert tok.vocab_size == len(hf)
    assert fast.get_vocab() == hf.get_vocab()


def test_gemma3_keeps_autotokenizer_and_its_bos():
    path = _store_dir("gemma-3-270m")
    tok = Tokenizer(path)
    assert not tok.fast_path
    assert tok.encode_prompt("Hello")[0] == tok.hf.bos_token_id


@pytest.mark.parametrize("change", [{"tokenizer_class": "GPT2Tokenizer"}, {"clean_up_tokenization_spaces": True},
                                    {"add_bos_token": True}, {"chat_template": [{"name": "default",
                                                                                 "template": "{{ messages }}"}]}])
def test_a_tokenizer_outside_the_proven_classes_loads_through_autotokenizer(smollm2_dir, tmp_path, change):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    from dflash2.models.tokenizer import _FastTokenizer

    assert _FastTokenizer.load(tmp_path) is None


def test_the_grammar_engine_reads_the_fast_paths_tokenizer(smollm2_dir):
    """Structured output hands ``Tokenizer.hf`` to xgrammar: it is transformers' tokenizer, loaded on that use."""
    xgrammar = pytest.importorskip("xgrammar")
    tok = Tokenizer(smollm2_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=tok.vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_builtin_json_grammar()
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tok.encode('{"a": 1}'):
        assert matcher.accept_token(token)
