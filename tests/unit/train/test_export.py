"""`dflash2 train export`: drafters in the layouts other engines load, checked against those loaders' rules."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash2.drafters.dflash_config import DFlashConfig
from dflash2.drafters.dflash_model import DFlashDraftModel
from dflash2.train.export import ExportError, dflash_layout_problems, export_drafter

MASK = 255


def tiny_dflash(**overrides) -> DFlashDraftModel:
    fields = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=256, target_layer_ids=(0, 2), mask_token_id=MASK, block_size=4)
    torch.manual_seed(0)
    return DFlashDraftModel(DFlashConfig(**{**fields, **overrides}))


def vllm_parallel_drafting_token(config: dict) -> int:
    """vLLM's rule for the id a parallel drafter feeds at its mask positions, restated from
    ``SpecDecodeBaseProposer._init_parallel_drafting_params`` (vllm-project/vllm, vllm/v1/spec_decode/eagle.py,
    commit f7eef1b6987f): ``dflash_config.mask_token_id``, else ``pard_token``, else ``ptd_token_id``, else an error."""
    dflash = config.get("dflash_config") or {}
    if "mask_token_id" in dflash:
        return dflash["mask_token_id"]
    for key in ("pard_token", "ptd_token_id"):
        if key in config:
            return config[key]
    raise ValueError("For parallel drafting, the draft model config must have `pard_token`, `ptd_token_id`, or "
                     "`dflash_config.mask_token_id` specified in its config.json.")


def test_the_vllm_rule_refuses_a_config_without_a_mask_id():
    """The broken-rule companion: the copy of vLLM's rule fails on what dflash2 exported before (mask_token_id
    at the top level only), so the test below can fail."""
    with pytest.raises(ValueError, match="pard_token"):
        vllm_parallel_drafting_token({"mask_token_id": MASK, "block_size": 4})


def test_pard_export_carries_the_mask_id_vllm_reads(tiny_model_dirs, tmp_path):
    from tests.unit.drafters.test_pard import write_random_adapter

    base = tiny_model_dirs["qwen2_other"]
    adapter = write_random_adapter(base, tmp_path / "adapter", MASK, num_draft_tokens=4)
    from dflash2.train.pard_export import export_pard

    out = export_pard(adapter, base, tmp_path / "vllm", "fp32")
    config = json.loads((out / "config.json").read_text())
    assert vllm_parallel_drafting_token(config) == MASK
    assert config["block_size"] == 4


def test_qk_norm_drafter_round_trips_and_norms_change_its_output(tmp_path):
    model = tiny_dflash(qk_norm=True)
    loaded = DFlashDraftModel.from_pretrained(model.save_pretrained(tmp_path / "d"))
    assert loaded.config.qk_norm and loaded.layers[0].attn.q_norm is not None
    for p, q in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    block = torch.randn(1, 4, 64)
    positions = torch.arange(8, 12)[None]
    context = model.project_context([torch.randn(1, 8, 64), torch.randn(1, 8, 64)])
    kv = model.context_kv(context, torch.arange(8)[None])
    before = model(block, positions, kv)
    with torch.no_grad():
        model.layers[0].attn.q_norm.weight.mul_(2.0)
    assert not torch.allclose(before, model(block, positions, model.context_kv(context, torch.arange(8)[None])))


@pytest.mark.parametrize("overrides, problem", [
    ({}, "no q/k norms"),
    ({"qk_norm": True, "attention_bias": True}, "biases"),
    ({"qk_norm": True, "draft_vocab_size": 32}, "draft vocabulary"),
    ({"qk_norm": True, "selector_rank": 8}, "path selector"),
])
def test_layouts_other_engines_cannot_load_are_refused_with_the_reason(tmp_path, overrides, problem):
    model = tiny_dflash(**overrides)
    assert any(problem in p for p in dflash_layout_problems(model.config))
    if model.draft_vocab is not None:
        model.set_draft_vocab(torch.arange(32))
    directory = model.save_pretrained(tmp_path / "d")
    with pytest.raises(ExportError, match=problem):
        export_drafter(directory, "llama.cpp", tmp_path / "out", target="tiny")


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm", "sglang"])
def test_dflash_export_writes_the_checkpoint_layout_the_converter_reads(tmp_path, engine):
    model = tiny_dflash(qk_norm=True)
    result = export_drafter(model.save_pretrained(tmp_path / "d"), engine, tmp_path / "out", target="tiny",
                            dtype="fp32")
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": MASK}
    assert "draft_vocab_size" not in config and config["attention_bias"] is False
    with safe_open(str(result.out_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert torch.equal(handle.get_tensor("fc.weight"), model.fc.weight.detach())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any(name.endswith(".bias") or "draft_vocab" in name for name in names)
    assert engine.split(".")[0] in result.how_to_serve


def test_pard_export_is_refused_for_engines_without_parallel_drafting(tmp_path, tiny_model_dirs):
    from tests.unit.drafters.test_pard import write_random_adapter

    adapter = write_random_adapter(tiny_model_dirs["qwen2_other"], tmp_path / "adapter", MASK, num_draft_tokens=4)
    with pytest.raises(ExportError, match="parallel-drafting"):
        export_drafter(adapter, "llama.cpp", tmp_path / "out", target="tiny")
