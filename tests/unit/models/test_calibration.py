"""The verify-cost calibration (DFLASH2_VERIFY_CALIBRATION=on): a target's forward time per row count, measured once
per machine, model, format and kernel code, cached in the store, and auto's tree-or-chain choice following it."""

from __future__ import annotations

import pytest

from dflash2.drafters import DraftTarget, build_drafter
from dflash2.drafters import spec as spec_module
from dflash2.kernels.packed_linear import PackedLinear
from dflash2.models import calibration
from dflash2.models.loading import load_transformer
from dflash2.platform import DraftHardware, VerifyCosts, reload_settings
from tests.unit.drafters.test_drafter_spec import EosTokenizer

FLAT = VerifyCosts((1, 2, 4, 8, 16), (0.10, 0.10, 0.10, 0.105, 0.11))  # AMX-tile-like: 16 rows ~ 1 row
STEEP = VerifyCosts((1, 2, 4, 8, 16), (0.10, 0.12, 0.16, 0.26, 0.45))  # AVX2-like: rows cost compute


def test_costs_interpolate_between_the_measured_row_counts():
    assert STEEP.at(4) == 0.16 and STEEP.at(1) == 0.10 and STEEP.at(32) == 0.45 and STEEP.at(0) == 0.10
    assert STEEP.at(12) == pytest.approx(0.26 + (0.45 - 0.26) * 4 / 8)
    assert FLAT.flat() and not STEEP.flat()  # 13 rows at <= 1.2x 4 rows
    assert STEEP.flat(tree_rows=5, chain_rows=4, limit=1.5)


def test_measured_costs_decide_where_they_exist_and_the_tile_rule_where_not():
    assert DraftHardware(tile_verification=True).flat_verification
    assert not DraftHardware(tile_verification=True, verify_costs=STEEP).flat_verification  # measured: steep
    assert DraftHardware(verify_costs=FLAT).flat_verification  # measured flat without AMX tiles: a tree
    name = "qwen2.5-coder-1.5b-instruct"
    assert spec_module.default_drafter(name, hardware=DraftHardware(verify_costs=FLAT)) == "pard+ngram:4x3"
    assert spec_module.default_drafter(name, hardware=DraftHardware(tile_verification=True, verify_costs=STEEP)) \
        == "pard+ngram:4x2"


def test_a_forward_per_row_count_is_timed_and_cached_per_model_format_and_machine(tiny_model_dirs, tmp_path,
                                                                                  monkeypatch):
    model = load_transformer(tiny_model_dirs["qwen2"], "fp32", packed=False)
    costs = calibration.verify_costs(model, home=tmp_path)
    assert costs.rows == calibration.ROWS and len(costs.seconds) == len(costs.rows)
    assert all(s > 0 for s in costs.seconds)
    [saved] = (tmp_path / "calibration").glob("*.json")
    assert saved.stem == calibration.calibration_key(model)

    def refuse(*args, **kwargs):
        raise AssertionError("measured although the store holds the costs")

    monkeypatch.setattr(calibration, "measure", refuse)
    assert calibration.verify_costs(model, home=tmp_path) == costs  # read back, not measured
    key = calibration.calibration_key(model)
    layer = model.layers[0].ffn
    layer.w_gate_up = PackedLinear.from_linear(layer.w_gate_up, backend="torch")
    assert calibration.calibration_key(model) != key  # another weight format: measured anew


def test_auto_follows_the_calibration_only_when_it_is_switched_on(tiny_model_dirs, tmp_path, monkeypatch):
    name = "/some/local/dir"
    monkeypatch.setattr(spec_module, "AUTO_DRAFTERS", (spec_module.AutoDrafter(name, False, "flat", "ngram:7", ""),
                                                       spec_module.AutoDrafter(name, False, "any", "ngram:3", "")))
    target = DraftTarget(load_transformer(tiny_model_dirs["qwen2"], "fp32", packed=False), EosTokenizer(), name)
    measured: list[VerifyCosts] = [FLAT]
    monkeypatch.setattr(calibration, "measure", lambda model: measured[0])
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    reload_settings()
    assert build_drafter("auto", target).num_draft_tokens == 3  # off: no AMX tiles here, the chain
    monkeypatch.setenv("DFLASH2_VERIFY_CALIBRATION", "on")
    reload_settings()
    assert build_drafter("auto", target).num_draft_tokens == 7  # measured flat: the tree row
    measured[0] = STEEP
    assert build_drafter("auto", target).num_draft_tokens == 7  # the store's costs, not measured again
    for path in (tmp_path / "calibration").glob("*.json"):
        path.unlink()
    assert build_drafter("auto", target).num_draft_tokens == 3  # measured steep: the chain
    assert build_drafter("ngram:5", target).num_draft_tokens == 5  # a named drafter needs no calibration
