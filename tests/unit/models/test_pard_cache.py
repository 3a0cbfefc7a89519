"""The store's cache of a merged, quantized PARD drafter (drafters/pard_load.py over models/packed_cache.ModelCache):
the second load reads it instead of merging and quantizing, with the same network; a changed adapter or a damaged
file is reported by one warning and rebuilt, never read as wrong weights; `dflash2 models show` names it."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from dflash2.drafters import pard_load
from dflash2.drafters.pard import DRAFT_VOCAB_FILE, VocabSubsetHead, load_pard_model
from dflash2.kernels.gguf_linear import GgufLinear, gguf_kernels_available
from dflash2.kernels.packed_linear import PackedLinear, kernels_available
from dflash2.kernels.prebuild import build_kernels
from dflash2.models import inventory
from dflash2.platform import reload_settings
from tests.unit.drafters.test_pard import MASK, write_random_adapter

pytestmark = pytest.mark.skipif(not (kernels_available() and gguf_kernels_available()),
                                reason="the packed and gguf CPU kernels are unavailable here")


@pytest.fixture
def drafter(tiny_model_dirs, tmp_path, monkeypatch):
    """(adapter directory with a draft vocabulary, base directory in a temporary store as models/tiny/bf16)."""
    list(build_kernels())  # loaded from the real store first: a temporary one would compile them all again
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "home"))
    reload_settings()
    base = tmp_path / "home" / "models" / "tiny" / "bf16"
    shutil.copytree(tiny_model_dirs["qwen2_other"], base)
    adapter = write_random_adapter(base, tmp_path / "adapter", MASK, num_draft_tokens=4)
    save_file({"draft_vocab": torch.arange(0, 250, 2, dtype=torch.int32)}, str(adapter / DRAFT_VOCAB_FILE))
    yield adapter, base
    reload_settings()


def cache_path(adapter, base, weights: str):
    model, config = load_pard_model(adapter, base, "bf16", weights=weights, packed=True)
    vocab = pard_load.read_draft_vocab(adapter).sort().values
    return pard_load.drafter_cache(adapter, base, config, "bf16", "cpu", weights, weights == "bf16", vocab).path


def outputs(model, ids=torch.arange(3, 40)) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None]).logits


def no_merge(*args, **kwargs):
    raise AssertionError("merged again: the cache was not read")


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "bf16"])
def test_the_second_load_reads_the_cache_and_computes_the_same(drafter, weights, monkeypatch):
    adapter, base = drafter
    built, config = load_pard_model(adapter, base, "bf16", weights=weights)  # merges, converts, writes
    path = cache_path(adapter, base, weights)
    assert path.is_file() and path.parent.parent == base.parent
    monkeypatch.setattr(pard_load, "merged_network", no_merge)
    cached, cached_config = load_pard_model(adapter, base, "bf16", weights=weights)
    assert cached_config == config
    kind = PackedLinear if weights == "bf16" else GgufLinear
    assert isinstance(cached.lm_head, VocabSubsetHead) and isinstance(cached.lm_head.head, kind)
    assert torch.equal(cached.lm_head.ids, built.lm_head.ids)
    assert isinstance(cached.layers[0].attn.wqkv, kind)
    assert torch.equal(cached.embed.weight, built.embed.weight)  # the mask embedding's row included
    assert torch.equal(outputs(cached), outputs(built))


def test_a_changed_adapter_is_merged_again(drafter, monkeypatch):
    adapter, base = drafter
    load_pard_model(adapter, base, "bf16", weights="q8_0")
    write_random_adapter(base, adapter, MASK, num_draft_tokens=4, seed=11)  # retrained in place: same path
    monkeypatch.setenv("DFLASH2_QUANT_CACHE", "off")
    reload_settings()
    fresh, _ = load_pard_model(adapter, base, "bf16", weights="q8_0")
    monkeypatch.delenv("DFLASH2_QUANT_CACHE")
    reload_settings()
    with pytest.warns(RuntimeWarning, match="merged pard drafter cache .*adapter is"):
        again, _ = load_pard_model(adapter, base, "bf16", weights="q8_0")
    assert torch.equal(outputs(again), outputs(fresh))
    monkeypatch.setattr(pard_load, "merged_network", no_merge)  # rewritten: the next load reads it
    assert torch.equal(outputs(load_pard_model(adapter, base, "bf16", weights="q8_0")[0]), outputs(fresh))


@pytest.mark.parametrize("damage", ["truncated", "header", "blocks"])
def test_a_damaged_cache_is_rebuilt(drafter, damage):
    adapter, base = drafter
    reference = outputs(load_pard_model(adapter, base, "bf16", weights="q8_0")[0])
    path = cache_path(adapter, base, "q8_0")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "header":
        data[8:24] = b"#" * 16
    else:  # a run's parameters (JSON in the metadata) claim other rows than its tensors hold: the layout check
        at = data.index(b'\\"out_features\\":') + len(b'\\"out_features\\":')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="merged pard drafter cache"):
        again, _ = load_pard_model(adapter, base, "bf16", weights="q8_0")
    assert torch.equal(outputs(again), reference)
    assert pard_load.drafter_cache(adapter, base, load_pard_model(adapter, base, "bf16", weights="q8_0")[1], "bf16",
                                   "cpu", "q8_0", False, pard_load.read_draft_vocab(adapter).sort().values
                                   ).read(again.config, torch.bfloat16, {"lm_head": 125}) is not None


def test_what_is_not_cached(drafter, tiny_model_dirs, monkeypatch):
    adapter, base = drafter
    config = pard_load.PardConfig.load(adapter)
    assert pard_load.drafter_cache(adapter, base, config, "bf16", "cpu", "int8", False, None) is None
    assert pard_load.drafter_cache(adapter, tiny_model_dirs["qwen2_other"], config, "bf16", "cpu", "q8_0", False,
                                   None) is None  # a base outside the store
    monkeypatch.setenv("DFLASH2_QUANT_CACHE", "off")
    reload_settings()
    assert pard_load.drafter_cache(adapter, base, config, "bf16", "cpu", "q8_0", False, None) is None


def test_models_show_names_the_cache_and_rm_takes_it(drafter):
    adapter, base = drafter
    load_pard_model(adapter, base, "bf16", weights="q8_0")
    folder = cache_path(adapter, base, "q8_0").parent
    part = inventory._part(folder)
    assert part.format.startswith("merged PARD drafter (q8_0, adapter adapter-")
    assert [f.path for f in part.files] == [f"models/tiny/{folder.name}/drafter.safetensors"]
    assert folder in [base.parent / p.path.split("/")[-1] for p in inventory._folder_parts(base.parent)]
