"""huge_page_copies: the same values, dtypes and shapes, in one buffer that starts on a huge-page boundary; when the
weights move there (DFLASH2_HUGE_PAGES, the fault-in probe)."""

from __future__ import annotations

import pytest
import torch

from dflash2.models.huge_pages import HUGE_PAGE, huge_page_copies
from dflash2.platform import reload_settings


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
    head into its own) with DFLASH2_HUGE_PAGES=on; off leaves them; the logits are the same either way."""
    from dflash2.models.huge_pages import ENV
    from dflash2.models.loading import load_transformer

    monkeypatch.setenv(ENV, "off")
    reload_settings()
    before = load_transformer(tiny_model_dirs["qwen2"], "bf16", weights=weights)
    monkeypatch.setenv(ENV, "on")  # (auto: also on, unless this process measured huge pages slow)
    reload_settings()
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
    from dflash2.models.huge_pages import ENV, move_linear_weights
    from dflash2.models.loading import load_transformer

    if not gl.gguf_kernels_available():
        pytest.skip(f"gguf kernel: {gl.gguf_kernel_status()}")
    monkeypatch.setenv(ENV, "on")
    reload_settings()
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


def test_mode_switch():
    from dflash2.models import huge_pages as hp

    for raw, mode in (("", "auto"), ("auto", "auto"), ("on", "on"), ("ALWAYS", "on"), ("off", "off"), ("0", "off"),
                      ("disabled", "off")):  # (every off value of platform.OFF_VALUES)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(hp.ENV, raw)
            reload_settings()
            assert hp.huge_pages_mode() == mode
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(hp.ENV, "sometimes")
        reload_settings()
        with pytest.raises(ValueError, match=hp.ENV):
            hp.huge_pages_mode()


def test_a_measured_fault_in_sets_the_probe(monkeypatch, tmp_path):
    from dflash2.models import huge_pages as hp

    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))  # a slow measurement writes its record here
    reload_settings()
    monkeypatch.setattr(hp, "_probe", hp._FaultProbe())
    huge_page_copies([torch.ones(1 << 20)], measure=True)  # 4 MiB: too small to tell
    assert hp._probe.seconds_per_gb is None
    huge_page_copies([torch.ones(4 << 20)], measure=True)  # 16 MiB
    assert hp._probe.seconds_per_gb is not None and hp._probe.seconds_per_gb > 0


@pytest.mark.parametrize("seconds_per_gb, mode, moved", [(8.0, "auto", False), (0.1, "auto", True), (8.0, "on", True),
                                                         (0.1, "off", False)])
def test_slow_huge_pages_leave_the_weights_in_auto_mode(tiny_model_dirs, monkeypatch, seconds_per_gb, mode, moved):
    """Where this process measured huge pages faulting in slowly (the Firecracker VMs: ~8 s per GB), auto mode moves
    nothing more; on moves anyway, off never; the logits are the same in every case."""
    from dflash2.models import huge_pages as hp
    from dflash2.models.loading import load_transformer

    monkeypatch.setenv(hp.ENV, "off")
    reload_settings()
    before = load_transformer(tiny_model_dirs["qwen2"], "bf16")
    monkeypatch.setenv(hp.ENV, mode)
    reload_settings()
    monkeypatch.setattr(hp, "_probe", hp._FaultProbe(seconds_per_gb=seconds_per_gb))
    model = load_transformer(tiny_model_dirs["qwen2"], "bf16")
    layer = model.layers[0]
    linears = (layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down)
    assert len({m.weight_data.untyped_storage().data_ptr() for m in linears}) == (1 if moved else 4)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before(ids).logits)


def _layer_buffers(model) -> int:
    """How many decoder layers had their four projections moved into one buffer."""
    def one(layer):
        linears = (layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down)
        return len({m.weight_data.untyped_storage().data_ptr() for m in linears}) == 1
    return sum(one(layer) for layer in model.layers)


def _fault_in_clock(monkeypatch, hp, seconds):
    """Every buffer's fault-in timed (tiny ones too), the n-th taking ``seconds[n]`` per GB of its size."""
    monkeypatch.setattr(hp, "_PROBE_BYTES", 0)
    durations = iter(seconds)
    ticks = {"now": 0.0, "start": True}
    sizes = []
    real_buffer = hp._huge_buffer

    def buffer(nbytes):
        sizes.append(nbytes)
        return real_buffer(nbytes)

    def clock():
        if not ticks["start"]:  # the end of a fault-in: its seconds per GB times its size
            ticks["now"] += next(durations) * sizes[-1] / 1e9
        ticks["start"] = not ticks["start"]
        return ticks["now"]

    monkeypatch.setattr(hp, "_huge_buffer", buffer)
    monkeypatch.setattr(hp.time, "perf_counter", clock)


def test_auto_mode_times_every_buffer_and_stops_at_the_first_slow_one(tiny_model_dirs, monkeypatch, tmp_path):
    """A first buffer that faults in fast does not vouch for the next ones (the Zen 4 VM: pages the guest had
    freed, then fresh ones at ~10 s per GB): the second, slow, stops the move; the logits are the same."""
    from dflash2.models import huge_pages as hp
    from dflash2.models.loading import load_transformer

    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    monkeypatch.setenv(hp.ENV, "off")
    reload_settings()
    before = load_transformer(tiny_model_dirs["qwen2"], "bf16")
    monkeypatch.setenv(hp.ENV, "auto")
    reload_settings()
    monkeypatch.setattr(hp, "_probe", hp._FaultProbe())
    monkeypatch.setattr(hp, "_boot_id", lambda: "boot-a")
    _fault_in_clock(monkeypatch, hp, [0.1, 9.0])
    model = load_transformer(tiny_model_dirs["qwen2"], "bf16")
    assert _layer_buffers(model) == 2 < len(model.layers)  # the fast one, the slow one, then nothing more
    assert hp._probe.seconds_per_gb == pytest.approx(9.0)
    assert hp.slow_record().read_text().split() == ["boot-a", "9.000"]
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before(ids).logits)


@pytest.mark.parametrize("recorded_boot, moved", [("boot-a", False), ("boot-b", True)])
def test_a_slow_record_of_this_boot_spares_later_processes_the_measurement(tiny_model_dirs, monkeypatch, tmp_path,
                                                                          recorded_boot, moved):
    """A later process (a fresh probe) of the boot whose record says slow moves nothing and times nothing; another
    boot's record is ignored (that process measures: fast here, so everything moves)."""
    from dflash2.models import huge_pages as hp
    from dflash2.models.loading import load_transformer

    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    monkeypatch.setenv(hp.ENV, "auto")
    reload_settings()
    hp.slow_record().write_text(f"{recorded_boot} 8.500\n")
    monkeypatch.setattr(hp, "_probe", hp._FaultProbe())
    monkeypatch.setattr(hp, "_boot_id", lambda: "boot-a")
    _fault_in_clock(monkeypatch, hp, [0.1] * 100)
    model = load_transformer(tiny_model_dirs["qwen2"], "bf16")
    assert _layer_buffers(model) == (len(model.layers) if moved else 0)
    assert hp._probe.seconds_per_gb == pytest.approx(0.1 if moved else 8.5)
    assert hp.slow_record().read_text().split() == [recorded_boot, "8.500"]  # a fast measurement writes nothing


def test_no_boot_id_no_record(monkeypatch, tmp_path):
    """Where the boot cannot be told (not Linux), a slow measurement is kept in the process only."""
    from dflash2.models import huge_pages as hp

    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    reload_settings()
    monkeypatch.setattr(hp, "_probe", hp._FaultProbe())
    monkeypatch.setattr(hp, "_boot_id", lambda: None)
    hp._measured(5.0)
    assert hp._probe.seconds_per_gb == 5.0 and not hp.slow_record().exists()
    assert hp._too_slow()
