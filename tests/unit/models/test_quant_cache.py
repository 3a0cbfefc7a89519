"""The model store's cache of quantized layers: the first load writes it, later loads read it instead of quantizing
(bitwise the same layers and logits), a stale / corrupt / incomplete cache is reported once and rebuilt, an
interrupted write leaves nothing, and nothing is written when the cache is off or the model is not in the store."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash2.kernels import quant_linear as ql
from dflash2.kernels.quant_linear import QuantLinear, quant_kernel_status, quant_kernels_available
from dflash2.models import quant_cache
from dflash2.models.loading import load_transformer
from dflash2.platform import reload_settings

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason=f"int8 kernel unavailable: {quant_kernel_status()}")


@pytest.fixture
def store(tmp_path, monkeypatch, tiny_model_dirs) -> dict[str, Path]:
    """A model store in tmp_path holding the tiny Qwen2 (biases, untied head) and Llama (tied head) as fp32."""
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    monkeypatch.delenv("DFLASH2_QUANT_CACHE", raising=False)
    reload_settings()
    dirs = {}
    for key in ("qwen2", "llama"):
        dirs[key] = tmp_path / "models" / f"tiny-{key}" / "fp32"
        shutil.copytree(tiny_model_dirs[key], dirs[key])
    return dirs


@pytest.fixture
def quantize_calls(monkeypatch) -> list[int]:
    """Counts the calls of QuantLinear.from_weight (the quantizer of a load)."""
    calls: list[int] = []
    original = QuantLinear.from_weight

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(QuantLinear, "from_weight", counted)
    return calls


def forbid_quantizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("quantized although the cache should have been read")

    monkeypatch.setattr(QuantLinear, "from_weight", refuse)


def fresh(model_dir: Path, dtype: str, weights: str, monkeypatch):
    """The model quantized now, with the cache off."""
    with monkeypatch.context() as patch:
        patch.setenv("DFLASH2_QUANT_CACHE", "off")
        reload_settings()
        model = load_transformer(model_dir, dtype, weights=weights)
    reload_settings()  # the cache on again
    return model


def quant_layers(model) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def cache_warnings(load) -> tuple[object, list[str]]:
    """(load(), the messages of the cache warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load()
    return model, [str(w.message) for w in caught if "quantized-weight cache" in str(w.message)]


def cache_file(model_dir: Path, weights: str, suffix: str = "") -> Path:
    return model_dir.parent / f"{model_dir.name}{suffix}-{weights}" / quant_cache.CACHE_FILE


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("key,dtype", [("qwen2", "fp32"), ("qwen2", "bf16"), ("llama", "fp32")])
def test_second_load_reads_the_cache_and_is_bitwise_the_quantized_model(store, monkeypatch, key, dtype, weights):
    model_dir = store[key]
    first = load_transformer(model_dir, dtype, weights=weights)
    path = cache_file(model_dir, weights, "" if dtype == "fp32" else f"-as-{dtype}")
    assert path.is_file() and not list(path.parent.glob("*.part"))
    reference = fresh(model_dir, dtype, weights, monkeypatch)
    forbid_quantizing(monkeypatch)
    cached, messages = cache_warnings(lambda: load_transformer(model_dir, dtype, weights=weights))
    assert messages == []
    expected, got = quant_layers(reference), quant_layers(cached)
    assert list(got) == list(expected) and len(got) == 4 * len(cached.layers) + 1
    for name, layer in got.items():
        ref = expected[name]
        assert (layer.weights, layer.backend, layer.in_features, layer.out_features) == \
               (ref.weights, ref.backend, ref.in_features, ref.out_features)
        assert torch.equal(layer.weight_data, ref.weight_data) and torch.equal(layer.scale_data, ref.scale_data)
        assert (layer.bias_data is None) == (ref.bias_data is None) == (key == "llama" or not name.endswith("wqkv"))
        assert layer.bias_data is None or torch.equal(layer.bias_data, ref.bias_data)
    assert cached.embed.weight.dtype == getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = cached(ids).logits
    assert torch.equal(logits, reference(ids).logits) and torch.equal(logits, first(ids).logits)


def test_the_torch_backend_reads_the_packed_cache(store, monkeypatch):
    load_transformer(store["qwen2"], "fp32", weights="int4")
    reference = quant_layers(fresh(store["qwen2"], "fp32", "int4", monkeypatch))
    monkeypatch.setattr(ql, "quant_kernels_available", lambda: False)
    forbid_quantizing(monkeypatch)
    cached = quant_layers(load_transformer(store["qwen2"], "fp32", weights="int4"))
    for name, layer in cached.items():
        assert layer.backend == "torch"
        for got, expected in zip(layer.quantized(), reference[name].quantized()):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("change,reason", [
    (lambda path, model_dir, patch: patch.setattr(quant_cache, "layout_tag", lambda: "another-layout"), "layout"),
    (lambda path, model_dir, patch: (model_dir / "model.safetensors").touch(), "source"),
    (lambda path, model_dir, patch: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), ""),
    (lambda path, model_dir, patch: path.write_bytes(b"not a safetensors file at all"), ""),
    (lambda path, model_dir, patch: _drop_a_tensor(path), "missing or unexpected"),
    (lambda path, model_dir, patch: _shift_a_tensor(path), "expected torch.int8"),
])
def test_a_stale_or_corrupt_cache_is_reported_once_and_rebuilt(store, monkeypatch, quantize_calls, change, reason):
    model_dir = store["qwen2"]
    load_transformer(model_dir, "fp32", weights="int8")
    path = cache_file(model_dir, "int8")
    written = len(quantize_calls)
    assert written == 4 * 3 + 1
    change(path, model_dir, monkeypatch)
    model, messages = cache_warnings(lambda: load_transformer(model_dir, "fp32", weights="int8"))
    assert len(messages) == 1 and reason in messages[0] and str(path) in messages[0]
    assert len(quantize_calls) == 2 * written  # quantized again
    expected = quant_layers(fresh(model_dir, "fp32", "int8", monkeypatch))
    assert all(torch.equal(layer.weight_data, expected[name].weight_data) for name, layer in quant_layers(model).items())
    forbid_quantizing(monkeypatch)  # rewritten: the next load reads it, silently
    assert cache_warnings(lambda: load_transformer(model_dir, "fp32", weights="int8"))[1] == []


def _tensors_and_metadata(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata()


def _drop_a_tensor(path: Path) -> None:
    tensors, metadata = _tensors_and_metadata(path)
    del tensors["layers.1.ffn.w_down.scale"]
    save_file(tensors, str(path), metadata)


def _shift_a_tensor(path: Path) -> None:
    tensors, metadata = _tensors_and_metadata(path)
    tensors["layers.0.attn.wo.weight"] = tensors["layers.0.attn.wo.weight"].to(torch.uint8)
    save_file(tensors, str(path), metadata)


def test_an_interrupted_write_leaves_no_cache(store, monkeypatch):
    model_dir = store["llama"]

    def interrupted(out, tensors, metadata, desc):
        out.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(quant_cache, "_write_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load_transformer(model_dir, "fp32", weights="int4")
    folder = cache_file(model_dir, "int4").parent
    assert list(folder.iterdir()) == []
    _, messages = cache_warnings(lambda: load_transformer(model_dir, "fp32", weights="int4"))
    assert messages == [] and cache_file(model_dir, "int4").is_file()


@pytest.mark.parametrize("value", ["off", "0", "false", "no"])
def test_a_disabled_cache_writes_nothing(store, monkeypatch, quantize_calls, value):
    monkeypatch.setenv("DFLASH2_QUANT_CACHE", value)
    reload_settings()
    before = sorted(p for p in store["qwen2"].parents[2].rglob("*"))
    load_transformer(store["qwen2"], "fp32", weights="int8")
    load_transformer(store["qwen2"], "fp32", weights="int8")
    assert sorted(p for p in store["qwen2"].parents[2].rglob("*")) == before
    assert len(quantize_calls) == 2 * (4 * 3 + 1)


def test_an_unknown_cache_setting_is_refused(store, monkeypatch):
    monkeypatch.setenv("DFLASH2_QUANT_CACHE", "sometimes")
    reload_settings()
    with pytest.raises(ValueError, match="DFLASH2_QUANT_CACHE='sometimes': expected on or off"):
        load_transformer(store["qwen2"], "fp32", weights="int8")


def test_a_model_directory_outside_the_store_is_not_cached(store, tiny_model_dirs, quantize_calls):
    own = Path(tiny_model_dirs["qwen2"])
    home = store["qwen2"].parents[2]
    before_own, before_home = sorted(own.rglob("*")), sorted(home.rglob("*"))
    load_transformer(own, "fp32", weights="int8")
    load_transformer(own, "fp32", weights="int8")
    assert sorted(own.rglob("*")) == before_own and sorted(home.rglob("*")) == before_home
    assert len(quantize_calls) == 2 * (4 * 3 + 1)


def test_the_cache_records_what_it_depends_on(store):
    load_transformer(store["llama"], "bf16", weights="int4")
    _, metadata = _tensors_and_metadata(cache_file(store["llama"], "int4", "-as-bf16"))
    assert metadata["format"] == "int4" and metadata["group_size"] == "32" and metadata["panel"] == "16"
    assert metadata["dtype"] == "bf16" and metadata["layout"] == quant_cache.layout_tag()
    assert metadata["source"] == quant_cache.source_identity(store["llama"].resolve())
    assert '"model.safetensors"' in metadata["source"]
