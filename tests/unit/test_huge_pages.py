"""huge_page_copies: the same values, dtypes and shapes, in one buffer that starts on a huge-page boundary."""

from __future__ import annotations

import pytest
import torch

from dflash2.models.huge_pages import HUGE_PAGE, huge_page_copies


def test_copies_are_equal_and_share_one_aligned_buffer():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(700, 900, generator=g), torch.arange(7, dtype=torch.int8),
               torch.randn(3, 5, generator=g).bfloat16(), torch.randint(0, 255, (4, 3, 32), dtype=torch.uint8)]
    copies = huge_page_copies(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 64 == 0
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1  # one buffer
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    tensors[0][0, 0] = 1e9  # copies, not views
    assert copies[0][0, 0] != 1e9


def test_refuses_non_contiguous_tensors():
    with pytest.raises(ValueError, match="contiguous CPU"):
        huge_page_copies([torch.randn(4, 6).T])


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_loaded_linear_weights_move_per_layer_and_compute_the_same(tiny_model_dirs, monkeypatch, weights):
    """load_transformer moves each decoder layer's packed / quantized weights into one huge-page buffer (and the
    head into its own); DFLASH2_HUGE_PAGES=off leaves them; the logits are the same either way."""
    from dflash2.models.huge_pages import ENV
    from dflash2.models.loading import load_transformer

    monkeypatch.setenv(ENV, "off")
    before = load_transformer(tiny_model_dirs["qwen2"], "bf16", weights=weights)
    monkeypatch.delenv(ENV)
    moved = load_transformer(tiny_model_dirs["qwen2"], "bf16", weights=weights)

    def buffers(layer):
        linears = (layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down)
        return {m.weight_data.untyped_storage().data_ptr() for m in linears}

    assert all(len(buffers(layer)) == 1 for layer in moved.layers)  # one buffer per layer
    assert len(set.union(*(buffers(layer) for layer in moved.layers))) == len(moved.layers)
    assert len(buffers(before.layers[0])) == 4
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(moved(ids).logits, before(ids).logits)


def test_gguf_layers_move_with_their_cpp_view_rebuilt(tiny_model_dirs, monkeypatch):
    """A GGUF layer's blocks move too; its C++ weights (made at a forward) are rebuilt from the moved tensors."""
    from dflash2.kernels import gguf_linear as gl
    from dflash2.models.huge_pages import move_linear_weights
    from dflash2.models.loading import load_transformer

    if not gl.gguf_kernels_available():
        pytest.skip(f"gguf kernel: {gl.gguf_kernel_status()}")
    model = load_transformer(tiny_model_dirs["qwen2"], "bf16", packed=False)
    for layer in model.layers:
        layer.ffn.w_down = gl.GgufLinear.from_linear(layer.ffn.w_down)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits
        model._gguf_layers = "stale"  # what kernels/gguf_layer.py caches: dropped by a move
        old = model.layers[0].ffn.w_down.parts[0].weight
        move_linear_weights(model)
        moved = model.layers[0].ffn.w_down.parts[0].weight
        assert moved.data_ptr() != old.data_ptr() and torch.equal(moved, old)
        assert "_gguf_layers" not in model.__dict__
        assert torch.equal(model(ids).logits, expected)
