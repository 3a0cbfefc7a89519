"""The store's packed copy of a bf16 model (models/packed_cache.py): the second load maps it and computes the same
logits as a load that packs; a stale or damaged cache is ignored with a warning and rewritten."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash2.kernels.prebuild import build_kernels
from dflash2.kernels.packed_linear import PackedLinear, kernels_available
from dflash2.models.loading import load_transformer
from dflash2.models.packed_cache import CACHE_FILE, PackedCache
from dflash2.platform import reload_settings

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the packed CPU kernels are unavailable here")


@pytest.fixture(params=["qwen2", "llama"])  # biases and an untied head; a tied head
def store_model(request, tiny_model_dirs, tmp_path, monkeypatch):
    """A tiny model placed in a temporary store as models/tiny/bf16."""
    list(build_kernels())  # loaded from the real store first: a temporary one would compile them all again
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "home"))
    reload_settings()  # (the kernels stay loaded from where this process first loaded them)
    directory = tmp_path / "home" / "models" / "tiny" / "bf16"
    shutil.copytree(tiny_model_dirs[request.param], directory)
    return directory


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None]).logits


def test_second_load_maps_the_cache_and_computes_the_same(store_model, tiny_model_dirs):
    ids = torch.arange(3, 40)
    packed = load_transformer(store_model, "bf16")  # packs, writes the cache
    cache = PackedCache.for_model(store_model, torch.bfloat16)
    assert cache is not None and cache.path.is_file() and cache.path.parent.name.startswith("bf16-packed-")
    mapped = load_transformer(store_model, "bf16")
    assert isinstance(mapped.lm_head, PackedLinear) and isinstance(mapped.layers[0].attn.wqkv, PackedLinear)
    assert torch.equal(logits(mapped, ids), logits(packed, ids))

    outside = load_transformer(tiny_model_dirs["qwen2"], "bf16")  # a directory of the user's: nothing written
    assert PackedCache.for_model(type(store_model)(tiny_model_dirs["qwen2"]), torch.bfloat16) is None
    assert outside.lm_head.out_features == packed.lm_head.out_features


def test_a_stale_or_damaged_cache_is_rewritten(store_model):
    ids = torch.arange(5, 30)
    reference = logits(load_transformer(store_model, "bf16"), ids)
    cache = PackedCache.for_model(store_model, torch.bfloat16)
    cache.path.write_bytes(cache.path.read_bytes()[:1000])  # cut short
    with pytest.warns(RuntimeWarning, match="packed-weight cache"):
        again = load_transformer(store_model, "bf16")
    assert torch.equal(logits(again, ids), reference)
    assert PackedCache.for_model(store_model, torch.bfloat16).read(again.config, torch.bfloat16) is not None

    (store_model / "config.json").touch()  # the source changed (its mtime): the metadata no longer matches
    with pytest.warns(RuntimeWarning, match="source"):
        assert torch.equal(logits(load_transformer(store_model, "bf16"), ids), reference)
    assert (cache.path.parent / CACHE_FILE).is_file()


@pytest.mark.parametrize("huge_pages", ["off", "on"])
def test_a_cache_read_prefaults_its_weights_and_copies_the_rest_only_when_they_moved(store_model, monkeypatch,
                                                                                     huge_pages):
    """Reading the cache asks for the pages of every layer's mapped tensors (models/prefault.py); the embedding and
    norms are copied out of the map only where the linear weights left it (huge pages), since otherwise the map
    stays and the copy would free nothing. The logits are the same either way."""
    from dflash2.models import loading, packed_cache

    ids = torch.arange(4, 33)
    reference = logits(load_transformer(store_model, "bf16"), ids)  # packs, writes the cache
    asked, copied = [], []
    monkeypatch.setattr(packed_cache, "prefault", lambda tensors: asked.extend(tensors))
    own_memory = loading.own_memory
    monkeypatch.setattr(loading, "own_memory", lambda model: copied.append(model) or own_memory(model))
    monkeypatch.setenv("DFLASH2_HUGE_PAGES", huge_pages)
    reload_settings()
    mapped = load_transformer(store_model, "bf16")
    linears = [m for m in mapped.modules() if isinstance(m, PackedLinear)]
    assert len(asked) == sum(1 + (m.bias_data is not None) for m in linears)
    if huge_pages == "off":  # the tensors asked for are the layers' own
        assert {t.data_ptr() for t in asked} == {t.data_ptr() for m in linears
                                                  for t in (m.weight_data, m.bias_data) if t is not None}
    assert copied == ([mapped] if huge_pages == "on" else [])
    assert torch.equal(logits(mapped, ids), reference)
