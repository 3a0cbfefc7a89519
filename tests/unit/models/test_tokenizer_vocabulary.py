"""Tokenizer.same_vocabulary: a drafter's tokenizer checked against the target's without loading it where the
vocabulary files are the same, and by loading it where they are not."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2.models import tokenizer as tokenizer_module
from dflash2.models.tokenizer import Tokenizer

pytestmark = pytest.mark.model

FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def smollm2_dir():
    from dflash2.models.store import resolve_model

    return resolve_model("smollm2-135m-instruct", "bf16")


def _copy(source, target, **config_changes):
    target.mkdir()
    for name in FILES:
        shutil.copy(source / name, target / name)
    if config_changes:
        config = json.loads((target / "tokenizer_config.json").read_text())
        (target / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return target


def test_the_same_files_need_no_second_tokenizer(smollm2_dir, tmp_path, monkeypatch):
    target = Tokenizer(smollm2_dir)
    twin = _copy(smollm2_dir, tmp_path / "twin", chat_template="{{ messages }}")  # another template, same vocabulary
    loads = []
    monkeypatch.setattr(tokenizer_module.Tokenizer, "fingerprint", lambda self: loads.append(self) or "x")
    assert target.same_vocabulary(twin)
    assert loads == []  # decided from the files: neither fingerprint was computed


def test_other_files_are_compared_by_loading(smollm2_dir, tmp_path):
    target = Tokenizer(smollm2_dir)
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    reformatted = _copy(smollm2_dir, tmp_path / "reformatted")
    (reformatted / "tokenizer.json").write_text(json.dumps(spec, indent=1))  # other bytes, the same vocabulary
    assert target.same_vocabulary(reformatted)
    spec["added_tokens"][0]["content"] = "<|renamed|>"
    renamed = _copy(smollm2_dir, tmp_path / "renamed")
    (renamed / "tokenizer.json").write_text(json.dumps(spec))
    assert not target.same_vocabulary(renamed)


def test_a_different_tokenizer_is_refused(smollm2_dir, tmp_path):
    from dflash2.models.store import resolve_model

    qwen = resolve_model("qwen2.5-coder-0.5b-instruct", "bf16")
    assert not Tokenizer(smollm2_dir).same_vocabulary(qwen)
    assert Tokenizer(qwen).same_vocabulary(resolve_model("qwen2.5-coder-1.5b-instruct", "bf16"))
