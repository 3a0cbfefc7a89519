"""Hugging Face repo ids through huggingface_hub's local cache (a pre-populated cache in a temporary folder): the
snapshot loads like a directory; a repo not in the cache is a one-line error naming the offline ways."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash2.models.loading import load_transformer
from dflash2.models.store import ModelStoreError, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dirs):
    """A hub cache holding tiny-org/tiny-qwen2 at COMMIT (refs/main), laid out as huggingface_hub writes it."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen2"
    shutil.copytree(tiny_model_dirs["qwen2"], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_repo_id_loads_like_its_directory(hub_cache, tiny_model_dirs):
    path = resolve_model("tiny-org/tiny-qwen2", "fp32")
    assert path == hub_cache / "models--tiny-org--tiny-qwen2" / "snapshots" / COMMIT
    ids = torch.arange(1, 20)[None]
    with torch.inference_mode():
        got = load_transformer(path, "fp32")(ids).logits
        expected = load_transformer(tiny_model_dirs["qwen2"], "fp32")(ids).logits
    assert torch.equal(got, expected)


def test_a_repo_not_in_the_cache_is_one_line_naming_the_local_ways(hub_cache):
    with pytest.raises(ModelStoreError) as error:
        resolve_model("someone/not-cached-model")
    message = str(error.value)
    assert "\n" not in message and "someone/not-cached-model" in message and str(hub_cache) in message
    assert "local directory" in message and ".gguf" in message and "huggingface-cli download" in message


def test_names_that_are_not_repo_ids_keep_their_error(hub_cache):
    with pytest.raises(ModelStoreError, match="unknown model 'no-such-model'.*repo id"):
        resolve_model("no-such-model")
